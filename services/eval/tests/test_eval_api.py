"""The eval gRPC surface on a real server, with runs scored by the OpenAI-compatible runner against
a real HTTP endpoint (a small scripted model server) or an unreachable one."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from fastapi import FastAPI
from forge.common.v1 import common_pb2
from forge.eval.v1 import eval_pb2, eval_pb2_grpc

from forge_eval.api import EvalApi, named_tokens
from forge_eval.registry import ModelRegistry
from forge_eval.runner import OpenAICompletionsRunner
from forge_eval.runs import RunService
from forge_eval.spec import BenchmarkCatalog
from forge_kit.db import Database
from forge_kit.grpckit import FIELD_METADATA_KEY, GrpcServer, make_channel
from forge_kit.http import HttpServer
from forge_kit.testing import eventually
from forge_kit.testing.grpcserver import grpc_test_server
from forge_kit.testing.processes import free_port

pytestmark = [pytest.mark.asyncio, pytest.mark.integration]
TOKEN = "test-token"
ADMIN_TOKEN = "alice-token"
USER_TOKEN = "ci-token"


def scripted_model_server(catalog: BenchmarkCatalog) -> FastAPI:
    """An OpenAI-compatible endpoint serving two 'models': tiny:good answers every GSM8K question
    with its reference answer, tiny:bad always says 42."""
    answers = {}
    for line in (catalog.root / "gsm8k" / "test.jsonl").read_text().splitlines():
        row = json.loads(line)
        answers[f"Question: {row['question']}\nAnswer:"] = row["answer"].split("####")[-1].strip()
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "tiny:good"}, {"id": "tiny:bad"}]}

    @app.post("/v1/completions")
    async def completions(body: dict[str, Any]) -> dict[str, Any]:
        assert body["temperature"] == 0.0 and body["max_tokens"] == 256
        text = (
            f" Let me think.\n#### {answers[body['prompt']]}" if body["model"] == "tiny:good" else " #### 42"
        )
        return {"choices": [{"text": text, "index": 0}]}

    return app


@pytest.fixture
async def model_endpoint(catalog: BenchmarkCatalog) -> AsyncIterator[str]:
    server = HttpServer(scripted_model_server(catalog), "127.0.0.1", 0)
    await server.start()
    yield f"http://127.0.0.1:{server.port}"
    await server.stop()


@pytest.fixture
async def eval_runs(db: Database, catalog: BenchmarkCatalog) -> RunService:
    return RunService(db, catalog, OpenAICompletionsRunner(catalog.root, timeout_s=5), default_endpoint="")


@pytest.fixture
async def server(db: Database, eval_runs: RunService) -> AsyncIterator[GrpcServer]:
    api = EvalApi(ModelRegistry(db), eval_runs, max_page_size=100)
    worker = asyncio.create_task(eval_runs.run_worker())
    async with grpc_test_server(
        eval_pb2_grpc.add_EvalServiceServicer_to_server,
        api,
        "forge.eval.v1.EvalService",
        token=TOKEN,
        service="eval",
        authenticators=[named_tokens({"alice": ADMIN_TOKEN}, {"ci": USER_TOKEN})],
    ) as started:
        yield started
    worker.cancel()
    # Wait for the worker to unwind before the database fixture disposes of its engine.
    await asyncio.gather(worker, return_exceptions=True)


@pytest.fixture
async def stub(server: GrpcServer) -> AsyncIterator[eval_pb2_grpc.EvalServiceStub]:
    async with make_channel(f"127.0.0.1:{server.port}", token=TOKEN) as channel:
        yield eval_pb2_grpc.EvalServiceStub(channel)


async def wait_finished(stub: eval_pb2_grpc.EvalServiceStub, run_id: str) -> eval_pb2.EvalRun:
    async def finished() -> eval_pb2.EvalRun | None:
        run = (await stub.GetRun(eval_pb2.GetRunRequest(run_id=run_id))).run
        return run if run.status in (eval_pb2.RUN_STATUS_SUCCEEDED, eval_pb2.RUN_STATUS_FAILED) else None

    run: eval_pb2.EvalRun = await eventually(finished, interval_s=0.02, what=f"run {run_id} to finish")
    return run


def ref(version: str) -> common_pb2.ModelRef:
    return common_pb2.ModelRef(name="tiny", version=version)


async def test_call_without_token_is_unauthenticated(server: GrpcServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await eval_pb2_grpc.EvalServiceStub(channel).ListModels(eval_pb2.ListModelsRequest())
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_registry_lifecycle_forced_promotion_and_audit_over_grpc(
    server: GrpcServer, stub: eval_pb2_grpc.EvalServiceStub
) -> None:
    first = await stub.RegisterModel(
        eval_pb2.RegisterModelRequest(
            ref=common_pb2.ModelRef(name="tiny"),
            uri="file:///ckpt/1",
            labels={"job": "j"},
            lineage=eval_pb2.Lineage(training_run_id="run-1", recipe_hash="r1", data_hash="d1"),
        )
    )
    second = await stub.RegisterModel(
        eval_pb2.RegisterModelRequest(
            ref=common_pb2.ModelRef(name="tiny"),
            uri="file:///ckpt/2",
            lineage=eval_pb2.Lineage(training_run_id="run-2", parent=ref("1")),
        )
    )
    assert first.model.stage == "candidate" and first.model.lineage.recipe_hash == "r1"
    assert second.model.lineage.parent.version == "1" and second.model.lineage.training_run_id == "run-2"

    # No eval run: refused; a non-admin may not force; an admin may, with a reason.
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.PromoteModel(eval_pb2.PromoteModelRequest(ref=ref("1"), stage="production"))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "has no eval runs; an admin may force it" in caught.value.details()
    forced = eval_pb2.PromoteModelRequest(ref=ref("1"), stage="production", force=True, reason="bootstrap")
    async with make_channel(f"127.0.0.1:{server.port}", token=USER_TOKEN) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await eval_pb2_grpc.EvalServiceStub(channel).PromoteModel(forced)
    assert (
        caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
        and "ci is not an admin" in caught.value.details()
    )
    async with make_channel(f"127.0.0.1:{server.port}", token=ADMIN_TOKEN) as channel:
        admin = eval_pb2_grpc.EvalServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await admin.PromoteModel(
                eval_pb2.PromoteModelRequest(ref=ref("1"), stage="production", force=True)
            )
        assert (FIELD_METADATA_KEY, "reason") in tuple(caught.value.trailing_metadata() or ())
        one = await admin.PromoteModel(forced)
        two = await admin.PromoteModel(
            eval_pb2.PromoteModelRequest(ref=ref("2"), stage="production", force=True, reason="hotfix")
        )
    assert one.event.forced and one.event.actor == "alice" and "no eval runs" in one.event.gate_report
    assert two.model.stage == "production" and two.previous.version == "1"

    back = await stub.RollbackModel(eval_pb2.RollbackModelRequest(stage="production", reason="bad"))
    assert (back.model.ref.version, back.rolled_back.version, back.event.actor) == ("1", "2", "service")
    listed = await stub.ListModels(eval_pb2.ListModelsRequest(stage="production"))
    assert [m.ref.version for m in listed.models] == ["1"] and listed.models[0].uri == "file:///ckpt/1"
    archived = await stub.ListModels(eval_pb2.ListModelsRequest(stage="archived"))
    assert [m.ref.version for m in archived.models] == ["2"]

    audit = await stub.ListStageEvents(eval_pb2.ListStageEventsRequest(forced_only=True))
    assert [(e.model.version, e.actor, e.reason) for e in audit.events] == [
        ("2", "alice", "hotfix"),
        ("1", "alice", "bootstrap"),
    ]
    history = await stub.ListStageEvents(
        eval_pb2.ListStageEventsRequest(model_name="tiny", model_version="1")
    )
    assert [(e.action, e.to_stage) for e in reversed(history.events)] == [
        ("register", "candidate"),
        ("promote", "production"),
        ("archive", "archived"),
        ("rollback", "production"),
    ]
    assert history.page.total_size == 4 and history.events[0].created_at.seconds > 0


async def test_invalid_request_names_the_field(stub: eval_pb2_grpc.EvalServiceStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.RunSuite(
            eval_pb2.RunSuiteRequest(
                suite="gsm8k", model=ref("1"), endpoint="http://x", options={"temp": "0"}
            )
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (FIELD_METADATA_KEY, "options.temp") in tuple(caught.value.trailing_metadata() or ())
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.RunSuite(eval_pb2.RunSuiteRequest(suite="gsm8k", model=ref("1")))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and caught.value.details().startswith(
        "endpoint:"
    )


async def test_run_without_a_reachable_endpoint_fails_with_the_reason(
    stub: eval_pb2_grpc.EvalServiceStub,
) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"
    started = await stub.RunSuite(
        eval_pb2.RunSuiteRequest(suite="gsm8k", model=ref("1"), endpoint=endpoint, limit=3)
    )
    run = await wait_finished(stub, started.run_id)
    assert (
        run.status == eval_pb2.RUN_STATUS_FAILED and f"model endpoint {endpoint} is unreachable" in run.error
    )
    assert run.spec_hash == started.spec_hash and not run.metrics


async def test_runs_against_a_real_endpoint_then_compare(
    stub: eval_pb2_grpc.EvalServiceStub, model_endpoint: str
) -> None:
    request = {"suite": "gsm8k", "endpoint": model_endpoint, "limit": 12, "seed": 5}
    good = await stub.RunSuite(eval_pb2.RunSuiteRequest(model=ref("good"), **request))
    bad = await stub.RunSuite(eval_pb2.RunSuiteRequest(model=ref("bad"), **request))
    good_run, bad_run = await wait_finished(stub, good.run_id), await wait_finished(stub, bad.run_id)
    assert good_run.status == eval_pb2.RUN_STATUS_SUCCEEDED, good_run.error
    assert good_run.example_count == 12
    metrics = {m.name: m for m in good_run.metrics}
    assert metrics["exact_match_strict"].value == 1.0 and metrics["exact_match_flexible"].value == 1.0
    assert {m.name: m.value for m in bad_run.metrics}["exact_match_strict"] < 0.5

    compared = await stub.CompareRuns(
        eval_pb2.CompareRunsRequest(baseline_run_id=bad.run_id, candidate_run_id=good.run_id)
    )
    assert compared.verdict == eval_pb2.VERDICT_BETTER
    strict = {d.name: d for d in compared.deltas}["exact_match_strict"]
    assert strict.n == 12 and strict.delta > 0.5 and strict.p_value < 0.01

    listed = await stub.ListRuns(eval_pb2.ListRunsRequest(suite="gsm8k", model_name="tiny"))
    assert {r.run_id for r in listed.runs} == {good.run_id, bad.run_id}
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.GetRun(eval_pb2.GetRunRequest(run_id="run-missing"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
