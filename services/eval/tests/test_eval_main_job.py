"""Eval's main-job step, end to end: a tiny checkpoint made here is announced with a real
``CheckpointPublished`` on the broker; the real orchestrator (a process) routes it to an
eval-and-promote workflow on the Temporal dev server; the real eval service (a process) runs the
release suite on a model server it starts from the checkpoint; the step, found through the
``forge.main_job`` entry points as ``forge up`` finds it, waits for that workflow and reports it.

The platform also has a model server and an inference gateway (processes) that follows eval's
``ModelPromoted`` events, whose metrics the orchestrator's guarded canary watches: a step that is
not told about them sends no traffic and its canary is rolled back; a step that is serves the
canary and chats through the gateway, and the canary is promoted on that evidence."""

from __future__ import annotations

import asyncio
import io
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from forge.eval.v1 import eval_pb2, eval_pb2_grpc
from forge.events.v1 import events_pb2
from rich.console import Console
from tiny_checkpoint import make_tiny_checkpoint, train_tiny_checkpoint

from forge_cli import mainjob
from forge_cli.mainjob import MainJobContext, ServiceEndpoint
from forge_eval.main_job import StepError, evaluate_checkpoint
from forge_kit.events import KafkaPublisher, ensure_topics
from forge_kit.grpckit import make_channel
from forge_kit.testing import ServiceProcess, TansuBroker, TemporalDevServer, base_env, eventkeys
from forge_kit.testing.processes import free_port

EVAL_TOKEN = "eval-main-job-token"
SERVER_TOKEN = "model-server-main-job-token"
GATEWAY_TOKEN = "gateway-main-job-token"
ORCHESTRATOR_TOKEN = "orchestrator-main-job-token"
#: The release suite of this test: held-out tinyshakespeare perplexity, 6 documents, each scored in
#: windows that fit the checkpoint's 32-token context.
RELEASE = {"RELEASE_SUITE": "tinyshakespeare_ppl", "RELEASE_LIMIT": "6"}


@pytest.fixture(scope="module")
def platform(
    kafka_broker: TansuBroker, temporal_server: TemporalDevServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, ServiceProcess]]:
    """The eval service (publishing ``ModelPromoted``), an empty model server, a gateway in front
    of it following the promotions, and an orchestrator whose consumer routes checkpoints to
    eval-and-promote and whose guarded canary reads the gateway's metrics."""
    asyncio.run(ensure_topics(kafka_broker.bootstrap))
    data = tmp_path_factory.mktemp("main-job")
    suffix = data.name[-8:]
    (data / "models").mkdir()
    started: list[ServiceProcess] = []

    def start(process: ServiceProcess) -> ServiceProcess:
        started.append(process)
        return process.start(60)

    # Eval and the model server need nothing of each other: they start at the same time.
    pool = ThreadPoolExecutor(2)
    starting_eval = pool.submit(
        start,
        ServiceProcess(
            "forge_eval",
            env=base_env(
                "eval",
                token=EVAL_TOKEN,
                data_dir=data / "eval",
                kafka=kafka_broker.bootstrap,
                response_cache_path=str(data / "eval" / "cache.sqlite"),
            ),
            log_path=str(data / "eval.log"),
        ),
    )
    starting_server = pool.submit(
        start,
        ServiceProcess(
            "forge_model_server",
            env=base_env(
                "model_server", token=SERVER_TOKEN, models_dir=str(data / "models"), torch_threads="1"
            ),
            cwd=str(data),
            log_path=str(data / "model_server.log"),
        ),
    )
    evals, server = starting_eval.result(), starting_server.result()
    pool.shutdown()
    gateway = start(
        ServiceProcess(
            "forge_inference_gateway",
            env=base_env(
                "inference_gateway",
                token=GATEWAY_TOKEN,
                data_dir=data / "gateway",
                kafka=kafka_broker.bootstrap,
                model_server_url=server.http_url,
                model_server_token=SERVER_TOKEN,
                # the default tenant, as whom the platform's own token (the steps') chats
                bootstrap_api_key="main-job-default-key",
                response_cache_ttl_s="0",
            ),
            cwd=str(data),
            log_path=str(data / "gateway.log"),
        )
    )
    orchestrator = ServiceProcess(
        "forge_orchestrator",
        env={
            **base_env(
                "orchestrator",
                token=ORCHESTRATOR_TOKEN,
                data_dir=data / "orchestrator",
                kafka=kafka_broker.bootstrap,
                temporal_target=temporal_server.target,
                task_queue=f"main-job-{suffix}",
                # forge up's canary policy (a window of seconds) on the gateway's metrics.
                canary_policy="local",
                gateway_metrics_urls=f'["{gateway.http_url}/metrics"]',
                consumer_group=f"main-job-{suffix}",
                consumer_session_timeout_ms="3000",
                scheduler_target=f"127.0.0.1:{free_port()}",
                eval_target=evals.grpc_target,
                eval_token=EVAL_TOKEN,
            ),
            **{f"FORGE_ORCHESTRATOR_{k}": v for k, v in RELEASE.items()},
        },
        log_path=str(data / "orchestrator.log"),
    )
    try:
        start(orchestrator)
        yield {
            "eval": evals,
            "orchestrator": orchestrator,
            "model_server": server,
            "inference_gateway": gateway,
        }
    finally:
        for process in reversed(started):
            process.stop()


TOKENS = {
    "eval": EVAL_TOKEN,
    "orchestrator": ORCHESTRATOR_TOKEN,
    "model_server": SERVER_TOKEN,
    "inference_gateway": GATEWAY_TOKEN,
}


def context(
    platform: dict[str, ServiceProcess], results: dict[str, dict[str, object]], *, traffic: bool = False
) -> MainJobContext:
    """The step's context: eval and the orchestrator, and with ``traffic`` the model server and
    the gateway too (a platform without them sends the canary no traffic)."""
    names = [*TOKENS] if traffic else ["eval", "orchestrator"]
    return MainJobContext(
        root=Path.cwd(),
        services={
            n: ServiceEndpoint(n, platform[n].grpc_target, platform[n].http_url, TOKENS[n]) for n in names
        },
        kafka_bootstrap="",
        temporal_target="",
        temporal_namespace="default",
        object_store_url="",
        results=results,
    )


async def test_the_step_needs_the_train_step_result() -> None:
    ctx = MainJobContext(Path.cwd(), {}, "", "", "default", "", results={"smoke": {"ok": True}})
    with pytest.raises(StepError, match=r"ctx.results has no 'train' entry \(steps done: smoke\)"):
        await evaluate_checkpoint(ctx)
    ctx.results["train"] = {"checkpoint_id": "c", "checkpoint_uri": "", "run_id": "r"}
    with pytest.raises(StepError, match=r"\['checkpoint_uri'\] must be a non-empty string"):
        await evaluate_checkpoint(ctx)


async def publish_checkpoint(bootstrap: str, run_id: str, step: int, checkpoint: Path) -> dict[str, object]:
    """Announce ``checkpoint`` as the trainer agent does; the train step's result for it."""
    publisher = KafkaPublisher(bootstrap, signer=eventkeys.signer("trainer_agent"))
    try:
        await publisher.publish(
            events_pb2.CheckpointPublished(
                job_id=f"job-{run_id}", run_id=run_id, step=step, uri=str(checkpoint)
            ),
            key=f"job-{run_id}",
        )
    finally:
        await publisher.close()
    return {"checkpoint_id": f"{run_id}:step-{step}", "checkpoint_uri": str(checkpoint), "run_id": run_id}


@pytest.mark.integration
async def test_the_trained_checkpoint_is_evaluated_and_promoted(
    platform: dict[str, ServiceProcess], kafka_broker: TansuBroker, tmp_path: Path
) -> None:
    """The first checkpoint has no production model to beat and is promoted; the next one, trained
    on the corpus, is compared with it on the same documents, beats it and goes to canary (as a
    second ``forge up`` does with the model the first one trained) — where, with no traffic
    through the gateway in the local policy's window, the guarded canary rolls it back; the one
    after, with the step chatting through the gateway, is promoted by the canary."""
    evals = platform["eval"]
    [eval_step] = [s for s in mainjob.discover() if s.name == "eval"]
    assert eval_step.order == 60

    checkpoint = make_tiny_checkpoint(tmp_path / "run-7" / "hf", context=32)
    # The next runs' trained checkpoint trains here while the platform evaluates this one.
    training = asyncio.create_task(
        asyncio.to_thread(
            lambda: train_tiny_checkpoint(
                make_tiny_checkpoint(tmp_path / "run-8" / "hf", context=32), steps=30
            )
        )
    )
    train = await publish_checkpoint(kafka_broker.bootstrap, "run-7", 10, checkpoint)
    started = time.monotonic()
    [outcome] = await mainjob.run(
        [eval_step], context(platform, {"train": train}), Console(file=io.StringIO())
    )
    assert outcome.ok, outcome.error
    assert time.monotonic() - started < eval_step.timeout_s
    result = outcome.result
    assert result["model"] == "run-7:step-10" and result["decision"] == "promoted"
    assert result["promoted_to"] == ["canary", "production"]
    scores, intervals = result["scores"], result["intervals"]
    assert isinstance(scores, dict) and isinstance(intervals, dict)
    low, high = intervals["bits_per_byte"]
    assert 1.0 < low <= scores["bits_per_byte"] <= high  # a random model: several bits per byte
    report = Path(str(result["report"]))
    assert report.is_file() and "run-7:step-10" in report.read_text()

    async with make_channel(evals.grpc_target, token=EVAL_TOKEN) as channel:
        stub = eval_pb2_grpc.EvalServiceStub(channel)
        [model] = (await stub.ListModels(eval_pb2.ListModelsRequest(name="run-7"))).models
        [served] = (await stub.ListRuns(eval_pb2.ListRunsRequest(model_name="run-7"))).runs
    assert model.stage == "production" and model.labels["workflow_id"] == result["workflow_id"]
    assert (
        served.serve_model and served.endpoint.startswith("http://127.0.0.1:") and served.example_count == 6
    )

    # The next run's checkpoint, trained: compared with production (run-7) and promoted over it.
    trained = await training
    train = await publish_checkpoint(kafka_broker.bootstrap, "run-8", 30, trained)
    [outcome] = await mainjob.run(
        [eval_step], context(platform, {"train": train}), Console(file=io.StringIO())
    )
    assert outcome.ok, outcome.error
    second = outcome.result
    assert second["model"] == "run-8:step-30" and second["baseline"] == "run-7:step-10"
    assert second["verdict"] == "BETTER" and second["decision"] == "rolled_back"
    assert second["promoted_to"] == ["canary"] and "too little traffic" in str(second["blocked_reason"])
    assert str(second["canary"]).startswith("rollback by analysis after ")
    assert "0 canary requests (local@2)" in str(second["canary"])
    assert second["canary_traffic"] == "no gateway in this platform"
    assert second["canary_evidence"]["requests"] == {"canary": 0, "production": 0}
    scores = second["scores"]
    assert isinstance(scores, dict) and scores["bits_per_byte"] < low  # below the random model's interval
    assert "comparison" in Path(str(second["report"])).name
    async with make_channel(evals.grpc_target, token=EVAL_TOKEN) as channel:
        stub = eval_pb2_grpc.EvalServiceStub(channel)
        production = (await stub.ListModels(eval_pb2.ListModelsRequest(stage="production"))).models
        baseline_runs = (await stub.ListRuns(eval_pb2.ListRunsRequest(model_name="run-7"))).runs
    assert [(m.ref.name, m.ref.version) for m in production] == [("run-7", "step-10")]
    # production was scored again on the same documents (its answers came from the response cache)
    assert len(baseline_runs) == 2 and {r.example_count for r in baseline_runs} == {6}

    # A third checkpoint, trained: to canary again, and now the step serves it and chats through
    # the gateway (a new user per request) until the analysis decides: promoted on the evidence.
    # (the same seeded training as run-8's, so a copy of its files)
    trained = Path(shutil.copytree(trained, tmp_path / "run-9" / "hf"))
    train = await publish_checkpoint(kafka_broker.bootstrap, "run-9", 30, trained)
    [outcome] = await mainjob.run(
        [eval_step], context(platform, {"train": train}, traffic=True), Console(file=io.StringIO())
    )
    assert outcome.ok, outcome.error
    third = outcome.result
    assert third["model"] == "run-9:step-30" and third["verdict"] == "BETTER", third
    sent = third["canary_traffic"]
    assert (
        isinstance(sent, dict) and sent["canary"] == "run-9:step-30" and sent["production"] == "run-7:step-10"
    )
    answered = sent["answered_by"]
    assert set(answered) == {"run-9:step-30", "run-7:step-10"}, f"{sent}"  # the sticky split by user
    assert third["decision"] == "promoted" and third["promoted_to"] == ["canary", "production"], third
    assert str(third["canary"]).startswith("promote by analysis after ")
    evidence = third["canary_evidence"]
    assert evidence["requests"]["canary"] >= 15 and evidence["requests"]["production"] >= 15
    assert evidence["p_values"]["errors"]["noninf_p"] <= 0.05  # the local policy's beta
    async with make_channel(evals.grpc_target, token=EVAL_TOKEN) as channel:
        stub = eval_pb2_grpc.EvalServiceStub(channel)
        production = (await stub.ListModels(eval_pb2.ListModelsRequest(stage="production"))).models
    assert [(m.ref.name, m.ref.version) for m in production] == [("run-9", "step-30")]
