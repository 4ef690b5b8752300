"""The guarded canary of eval-and-promote on the real Temporal dev server and the real eval service
(a subprocess): each analysis outcome, a crashed canary replica, no traffic, an operator's
override, and a worker restart in the middle of the window.

The analysis reads Prometheus expositions over HTTP. Here the exposition is served by the test
(the gateway's metric names and labels, from a ``prometheus_client`` registry) and fed with per-
request outcomes at a fixed rate, so each scenario's traffic is known; the real gateway producing
these metrics is covered by the gateway's tests and by ``forge bench canary``.
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from forge.common.v1 import common_pb2
from forge.eval.v1 import eval_pb2, eval_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from temporalio.client import Client

from forge_kit.grpckit import make_channel
from forge_kit.http import HttpServer
from forge_kit.latency import LATENCY_BUCKETS
from forge_kit.paths import data_dir
from forge_kit.testing import ServiceProcess, TemporalDevServer, base_env, eventually
from forge_orchestrator.activities import SchedulerActivities
from forge_orchestrator.eval_activities import EvalActivities
from forge_orchestrator.promote.canary_activities import CanaryActivities
from forge_orchestrator.promote.model import EvalAndPromoteInput, EvalAndPromoteResult
from forge_orchestrator.service import build_worker

EVAL_TOKEN = "eval-canary-token"
BENCHMARKS = data_dir() / "benchmarks"
#: The window is long enough that an identical canary is promoted well within it on a loaded
#: machine (three test folders on two cores stretch every look); the extension is short.
WINDOW_S, EXTENSION_S = 10, 2
POLICY = f"""family: tiny
version: 3
traffic_percent: 25
window_s: {WINDOW_S}
interval_s: 0.5
extension_s: {EXTENSION_S}
max_extensions: 1
min_requests: 40
alpha: 0.05
beta: 0.05
metrics:
  errors:   {{margin: 0.05, harm_margin: 0.0,  tau: 0.10}}
  ttft_p95: {{margin: 0.10, harm_margin: 0.03, tau: 0.10}}
"""


def answering_endpoint() -> FastAPI:
    """Every model answers each GSM8K question right, so every candidate passes the eval gate."""
    answers = {}
    for line in (BENCHMARKS / "gsm8k" / "test.jsonl").read_text().splitlines():
        row = json.loads(line)
        answers[row["question"]] = row["answer"].split("####")[-1].strip()
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        versions = ("base", "same", "errors", "slow", "crash", "quiet", "restart", "manual")
        return {"object": "list", "data": [{"id": f"tiny:{v}"} for v in versions]}

    @app.post("/v1/completions")
    async def completions(body: dict[str, Any]) -> dict[str, Any]:
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        choices = []
        for i, prompt in enumerate(prompts):
            found = [(prompt.rfind(q), a) for q, a in answers.items() if q in prompt]
            text = f" Let me think.\n#### {max(found)[1]}" if found else " I don't know."
            choices.append({"index": i, "text": text, "finish_reason": "stop"})
        return {"object": "text_completion", "choices": choices}

    return app


@dataclass
class Traffic:
    """Per-request outcomes fed into gateway-named metrics at ``rate`` requests/s per arm."""

    canary: str = ""
    production: str = ""
    rate: float = 60.0
    canary_error: float = 0.0
    canary_status: str = "500"
    canary_slow: float = 1.0
    on: bool = False


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "forge_gateway_upstream_requests", "", ["model", "split", "status"], registry=self.registry
        )
        self.ttft = Histogram(
            "forge_gateway_time_to_first_token_seconds",
            "",
            ["model", "split"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.traffic = Traffic()
        self.rng = random.Random(7)

    def app(self) -> FastAPI:
        app = FastAPI()
        app.add_api_route("/metrics", lambda: PlainTextResponse(generate_latest(self.registry).decode()))
        return app

    async def run(self) -> None:
        tick = 0.05
        while True:
            await asyncio.sleep(tick)
            t = self.traffic
            if not t.on:
                continue
            for _ in range(max(1, round(t.rate * tick))):
                self.requests.labels(t.production, "stable", "200").inc()
                self.ttft.labels(t.production, "stable").observe(self.rng.lognormvariate(-3.2, 0.2))
                if self.rng.random() < t.canary_error:
                    self.requests.labels(t.canary, "canary", t.canary_status).inc()
                    continue
                self.requests.labels(t.canary, "canary", "200").inc()
                self.ttft.labels(t.canary, "canary").observe(
                    self.rng.lognormvariate(-3.2, 0.2) * t.canary_slow
                )


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


@dataclass
class Rig:
    client: Client
    queue: str
    endpoint: str
    metrics: GatewayMetrics
    metrics_url: str
    policies: Path
    eval_target: str

    def worker(self) -> Any:
        return build_worker(
            self.client,
            self.queue,
            SchedulerActivities("127.0.0.1:1", "unused"),
            EvalActivities(self.eval_target, EVAL_TOKEN),
            canary=CanaryActivities([self.metrics_url], policy_dir=self.policies),
            guard=None,
        )

    def params(self, version: str) -> EvalAndPromoteInput:
        return EvalAndPromoteInput(
            model_name="tiny",
            model_version=version,
            uri=f"file:///models/tiny-{version}",
            suite="gsm8k",
            limit=6,
            endpoint=self.endpoint,
            poll_s=0.2,
            run_timeout_s=120,
        )

    async def release(self, version: str, **traffic: Any) -> EvalAndPromoteResult:
        """Run eval-and-promote of ``tiny:version`` with canary traffic shaped by ``traffic``."""
        production = await holder(self.eval_target, "production")
        self.metrics.traffic = Traffic(canary=f"tiny:{version}", production=production, **traffic)
        async with self.worker():
            result: EvalAndPromoteResult = await self.client.execute_workflow(
                "eval_and_promote",
                self.params(version),
                id=f"{self.queue}-{version}",
                task_queue=self.queue,
                result_type=EvalAndPromoteResult,
            )
        self.metrics.traffic.on = False
        return result


async def holder(target: str, stage: str) -> str:
    async with make_channel(target, token=EVAL_TOKEN) as channel:
        reply = await eval_pb2_grpc.EvalServiceStub(channel).ListModels(
            eval_pb2.ListModelsRequest(stage=stage)
        )
    return f"{reply.models[0].ref.name}:{reply.models[0].ref.version}" if reply.models else ""


async def history(target: str, version: str) -> list[eval_pb2.StageEvent]:
    async with make_channel(target, token=EVAL_TOKEN) as channel:
        reply = await eval_pb2_grpc.EvalServiceStub(channel).ListStageEvents(
            eval_pb2.ListStageEventsRequest(model_name="tiny", model_version=version)
        )
    return list(reply.events)


@pytest.fixture
async def rig(
    temporal_server: TemporalDevServer, eval_service: ServiceProcess, tmp_path: Path
) -> AsyncIterator[Rig]:
    endpoint = HttpServer(answering_endpoint(), "127.0.0.1", 0)
    metrics = GatewayMetrics()
    exposition = HttpServer(metrics.app(), "127.0.0.1", 0)
    await endpoint.start()
    await exposition.start()
    feeder = asyncio.create_task(metrics.run())
    (tmp_path / "tiny.yaml").write_text(POLICY)
    client = await Client.connect(temporal_server.target)
    rig = Rig(
        client,
        f"canary-{uuid.uuid4().hex[:8]}",
        f"http://127.0.0.1:{endpoint.port}",
        metrics,
        f"http://127.0.0.1:{exposition.port}/metrics",
        tmp_path,
        eval_service.grpc_target,
    )
    if not await holder(eval_service.grpc_target, "production"):
        first = await rig.release("base")
        assert first.promoted_to == ["canary", "production"] and first.canary == {}
    yield rig
    feeder.cancel()
    await asyncio.gather(feeder, return_exceptions=True)
    await exposition.stop()
    await endpoint.stop()


async def traffic_on_when_canary(rig: Rig) -> None:
    """Start the canary's traffic once the workflow has put it in canary (as a gateway would)."""

    async def in_canary() -> bool:
        wanted = rig.metrics.traffic.canary
        return bool(wanted) and await holder(rig.eval_target, "canary") == wanted

    await eventually(in_canary, what="the candidate to reach canary")
    rig.metrics.traffic.on = True


@pytest.mark.integration
@pytest.mark.asyncio
async def test_identical_canary_is_promoted_with_its_evidence_recorded(rig: Rig) -> None:
    switch = asyncio.create_task(traffic_on_when_canary(rig))
    before = await holder(rig.eval_target, "production")
    result = await rig.release("same")
    await switch
    assert result.decision == "promoted" and result.promoted_to == ["canary", "production"]
    canary = result.canary
    assert (
        canary["decision"] == "promote" and canary["policy"] == "tiny@3" and canary["traffic_percent"] == 25
    )
    # Shown no worse by the sequential test, before the window ran out.
    assert canary["canary_requests"] >= 40 and canary["decided_after_s"] < WINDOW_S
    assert await holder(rig.eval_target, "production") == "tiny:same"
    [promoted, *_] = await history(rig.eval_target, "same")
    assert (promoted.action, promoted.from_stage, promoted.to_stage) == ("promote", "canary", "production")
    evidence = json.loads(promoted.evidence)
    assert evidence["decision"] == "promote" and set(evidence["metrics"]) == {"errors", "ttft_p95"}
    # The old production is archived, not gone: one rollback restores it.
    archived = await history(rig.eval_target, before.split(":")[1])
    assert archived[0].to_stage == "archived"


@pytest.mark.integration
@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("version", "traffic", "metric"),
    [
        ("errors", {"canary_error": 0.15}, "errors"),
        ("slow", {"canary_slow": 1.5}, "ttft_p95"),
        ("crash", {"canary_error": 1.0, "canary_status": "unavailable"}, "errors"),
    ],
)
async def test_a_worse_canary_is_rolled_back_and_the_gateway_told(
    rig: Rig, version: str, traffic: dict[str, Any], metric: str
) -> None:
    switch = asyncio.create_task(traffic_on_when_canary(rig))
    production = await holder(rig.eval_target, "production")
    result = await rig.release(version, **traffic)
    await switch
    assert result.decision == "rolled_back" and result.promoted_to == ["canary"]
    assert result.canary["decision"] == "rollback" and metric in result.canary["reason"]
    assert result.blocked_reason.startswith("canary rolled back (analysis)")
    assert await holder(rig.eval_target, "production") == production
    assert await holder(rig.eval_target, "canary") == ""
    [rolled, *_] = await history(rig.eval_target, version)
    assert (rolled.action, rolled.from_stage, rolled.to_stage) == ("rollback", "canary", "archived")
    assert json.loads(rolled.evidence)["metrics"][metric]["harm_p"] <= 0.025


@pytest.mark.integration
@pytest.mark.asyncio
async def test_no_traffic_extends_then_rolls_back_never_promotes(rig: Rig) -> None:
    result = await rig.release("quiet")
    assert result.decision == "rolled_back" and result.canary["extensions"] == 1
    assert "too little traffic: 0 requests per arm" in result.canary["reason"]
    assert result.canary["decided_after_s"] >= WINDOW_S + EXTENSION_S
    actions = [e.action for e in await history(rig.eval_target, "quiet")]
    assert actions[:2] == ["rollback", "extend"]


@pytest.mark.integration
@pytest.mark.asyncio
async def test_the_window_survives_a_worker_restart_and_an_operator_can_override(rig: Rig) -> None:
    production = await holder(rig.eval_target, "production")
    rig.metrics.traffic = Traffic(canary="tiny:restart", production=production, canary_error=0.15)
    async with rig.worker():
        handle = await rig.client.start_workflow(
            "eval_and_promote", rig.params("restart"), id=f"{rig.queue}-restart", task_queue=rig.queue
        )

        async def analysing() -> bool:
            return bool((await handle.query("progress"))["step"] == "canary analysis")

        await eventually(analysing, what="the canary analysis to start")
    # The worker is gone mid-window (its timer is in Temporal); traffic flows meanwhile.
    rig.metrics.traffic.on = True
    await asyncio.sleep(1.5)
    async with rig.worker():
        result = await handle.result()
    assert result["decision"] == "rolled_back" and "errors" in result["canary"]["reason"]

    # An operator's rollback mid-window ends the analysis with their decision (audited).
    rig.metrics.traffic = Traffic(canary="tiny:manual", production=production)
    async with rig.worker():
        handle = await rig.client.start_workflow(
            "eval_and_promote", rig.params("manual"), id=f"{rig.queue}-manual", task_queue=rig.queue
        )

        async def in_canary() -> bool:
            return await holder(rig.eval_target, "canary") == "tiny:manual"

        await eventually(in_canary, what="tiny:manual to reach canary")
        async with make_channel(rig.eval_target, token=EVAL_TOKEN) as channel:
            stub = eval_pb2_grpc.EvalServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.DecideRollout(
                    eval_pb2.DecideRolloutRequest(
                        ref=common_pb2.ModelRef(name="tiny", version="manual"), decision="pause"
                    )
                )
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            await stub.DecideRollout(
                eval_pb2.DecideRolloutRequest(
                    ref=common_pb2.ModelRef(name="tiny", version="manual"),
                    decision="rollback",
                    reason="on-call: pager",
                )
            )
        result = await handle.result()
    assert result["decision"] == "rolled_back" and result["canary"]["decided_by"] == "service"
    assert "on-call: pager" in result["canary"]["reason"]
