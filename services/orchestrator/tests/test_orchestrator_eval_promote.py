"""The eval-and-promote workflow on the real Temporal dev server, driving the real eval service
(a subprocess) whose runs score an OpenAI-compatible endpoint serving two models: ``tiny:good``
answers every GSM8K question correctly, ``tiny:bad`` always answers 42."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from forge.eval.v1 import eval_pb2, eval_pb2_grpc
from temporalio.client import Client

from forge_kit.grpckit import make_channel
from forge_kit.http import HttpServer
from forge_kit.paths import data_dir
from forge_kit.testing import ServiceProcess, TemporalDevServer, base_env
from forge_orchestrator.activities import SchedulerActivities
from forge_orchestrator.eval_activities import EvalActivities
from forge_orchestrator.event_handlers import CheckpointHandler
from forge_orchestrator.promote.model import EvalAndPromoteInput, EvalAndPromoteResult
from forge_orchestrator.promote.service import validate_eval_and_promote
from forge_orchestrator.service import build_worker, parse_input

EVAL_TOKEN = "eval-test-token"
BENCHMARKS = data_dir() / "benchmarks"


def gsm8k_answers() -> dict[str, str]:
    answers = {}
    for line in (BENCHMARKS / "gsm8k" / "test.jsonl").read_text().splitlines():
        row = json.loads(line)
        answers[row["question"]] = row["answer"].split("####")[-1].strip()
    return answers


def scripted_endpoint(answers: dict[str, str]) -> FastAPI:
    """Answers the question that appears last in the prompt (few-shot prompts hold several)."""
    app = FastAPI()

    def reply(model: str, prompt: str) -> str:
        if model != "tiny:good":
            return " The answer is 42.\n#### 42"
        found = [(prompt.rfind(q), a) for q, a in answers.items() if q in prompt]
        if not found:
            return " I don't know."
        return f" Let me think.\n#### {max(found)[1]}"

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "tiny:good"}, {"id": "tiny:bad"}]}

    @app.post("/v1/completions")
    async def completions(body: dict[str, Any]) -> dict[str, Any]:
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        choices = [
            {"index": i, "text": reply(body["model"], p), "finish_reason": "stop"}
            for i, p in enumerate(prompts)
        ]
        return {"object": "text_completion", "model": body["model"], "choices": choices}

    @app.post("/v1/chat/completions")
    async def chat(body: dict[str, Any]) -> dict[str, Any]:
        prompt = "\n".join(m["content"] for m in body["messages"])
        message = {"role": "assistant", "content": reply(body["model"], prompt)}
        return {
            "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        }

    return app


@pytest.fixture(scope="module")
def eval_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    data = tmp_path_factory.mktemp("eval")
    process = ServiceProcess(
        "forge_eval",
        env=base_env("eval", token=EVAL_TOKEN, data_dir=data, benchmarks_dir=str(BENCHMARKS)),
        log_path=str(data / "eval.log"),
    ).start()
    yield process
    process.stop()


@pytest.fixture
async def endpoint() -> AsyncIterator[str]:
    server = HttpServer(scripted_endpoint(gsm8k_answers()), "127.0.0.1", 0)
    await server.start()
    yield f"http://127.0.0.1:{server.port}"
    await server.stop()


async def production_model(target: str) -> tuple[str, str] | None:
    async with make_channel(target, token=EVAL_TOKEN) as channel:
        stub = eval_pb2_grpc.EvalServiceStub(channel)
        reply = await stub.ListModels(eval_pb2.ListModelsRequest(stage="production"))
    return (reply.models[0].ref.name, reply.models[0].ref.version) if reply.models else None


@pytest.mark.integration
@pytest.mark.asyncio
async def test_good_candidate_is_promoted_and_a_regression_is_blocked(
    temporal_server: TemporalDevServer, eval_service: ServiceProcess, endpoint: str
) -> None:
    client = await Client.connect(temporal_server.target)
    queue = f"eval-promote-{uuid.uuid4().hex[:8]}"
    scheduler = SchedulerActivities("127.0.0.1:1", "unused")
    evals = EvalActivities(eval_service.grpc_target, EVAL_TOKEN)

    def params(version: str) -> EvalAndPromoteInput:
        return EvalAndPromoteInput(
            model_name="tiny",
            model_version=version,
            uri=f"file:///models/tiny-{version}",
            suite="gsm8k",
            limit=12,
            endpoint=endpoint,
            poll_s=0.2,
            run_timeout_s=120,
        )

    async with build_worker(client, queue, scheduler, evals, guard=None):
        good: EvalAndPromoteResult = await client.execute_workflow(
            "eval_and_promote",
            params("good"),
            id=f"{queue}-good",
            task_queue=queue,
            result_type=EvalAndPromoteResult,
        )
        assert good.promoted_to == ["canary", "production"] and good.baseline == ""
        assert await production_model(eval_service.grpc_target) == ("tiny", "good")

        bad: EvalAndPromoteResult = await client.execute_workflow(
            "eval_and_promote",
            params("bad"),
            id=f"{queue}-bad",
            task_queue=queue,
            result_type=EvalAndPromoteResult,
        )
    await evals.close()
    assert bad.baseline == "tiny:good" and bad.verdict == "WORSE"
    assert bad.promoted_to == [] and bad.blocked_reason.startswith("regression against production tiny:good")
    report = Path(bad.report_path)  # eval wrote the comparison the release was blocked on
    assert bad.decision == "blocked" and report.name == "comparison.md"
    assert "verdict: **WORSE**" in report.read_text() and good.decision == "promoted"
    assert await production_model(eval_service.grpc_target) == ("tiny", "good")


class RecordingStarter:
    def __init__(self) -> None:
        self.started: list[tuple[str, dict[str, object], str]] = []

    async def start_workflow(
        self, workflow_type: str, data: dict[str, object], workflow_id: str = ""
    ) -> tuple[str, str]:
        self.started.append((workflow_type, dict(data), workflow_id))
        return workflow_id, "run"


@pytest.mark.asyncio
async def test_a_published_checkpoint_starts_one_idempotent_eval_workflow() -> None:
    from forge.events.v1 import events_pb2

    starter = RecordingStarter()
    handler = CheckpointHandler(starter, suite="tinyshakespeare_ppl", limit=50, tier="smoke")
    event = events_pb2.CheckpointPublished(run_id="pretrain-7", step=2000, uri="file:///ckpt/hf")
    await handler.handle(event, session=None)  # type: ignore[arg-type]
    await handler.handle(events_pb2.CheckpointPublished(run_id="x", step=1), session=None)  # type: ignore[arg-type]
    [(kind, data, workflow_id)] = starter.started
    assert kind == "eval_and_promote" and workflow_id == "eval-pretrain-7-step-2000"
    assert data["model_name"] == "pretrain-7" and data["model_version"] == "step-2000"
    assert (data["suite"], data["limit"], data["tier"]) == ("tinyshakespeare_ppl", 50, "smoke")
    validate_eval_and_promote(EvalAndPromoteInput(**data))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model_name": ""}, "input.model_name"),
        ({"uri": ""}, "input.uri"),
        ({"canary_percent": 101}, "input.canary_percent"),
        ({"tier": "fast"}, "input.tier"),
        ({"tier": "Smoke"}, "input.tier"),
    ],
)
def test_bad_eval_and_promote_input_names_the_field(change: dict[str, object], field: str) -> None:
    from forge_kit import errors

    values: dict[str, Any] = {"model_name": "tiny", "model_version": "1", "uri": "file:///m", **change}
    with pytest.raises(errors.ValidationError) as caught:
        validate_eval_and_promote(EvalAndPromoteInput(**values))
    assert caught.value.field == field


def test_an_unknown_tier_is_refused_when_the_workflow_is_started() -> None:
    """The API's input parser (StartWorkflow, and the checkpoint handler's start) refuses it with
    the field named, before any workflow exists; the two known tiers are accepted."""
    from forge_kit import errors

    data: dict[str, object] = {"model_name": "tiny", "model_version": "1", "uri": "file:///m"}
    with pytest.raises(errors.ValidationError, match=r"must be one of full, smoke, got 'quick'") as caught:
        parse_input(EvalAndPromoteInput, {**data, "tier": "quick"})
    assert caught.value.field == "input.tier"
    for tier in ("full", "smoke"):
        assert parse_input(EvalAndPromoteInput, {**data, "tier": tier}).tier == tier
    assert parse_input(EvalAndPromoteInput, data).suite == "tinyshakespeare_ppl"
