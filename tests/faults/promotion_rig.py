"""Harness of the promotion scenarios: the registry (eval), the gateway consuming its
``ModelPromoted`` events, Temporal and an orchestrator whose wall clock is ten minutes ahead
(libfaketime), wired as ``forge up`` wires them, with every Kafka connection through a fault
proxy (``broker``: Tansu advertises the proxy's port).

Two things a real fleet would provide are served by the test: an OpenAI-compatible endpoint that
answers every GSM8K question right (so each candidate passes the eval gate and reaches the canary),
and the gateway's canary metrics (its metric names and labels, fed at a fixed rate per arm while
``Traffic.on``), so each canary's traffic is known. The gateway's own metrics are covered by its
tests and ``forge bench canary``.
"""

from __future__ import annotations

import asyncio
import json
import random
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from forge.common.v1 import common_pb2
from forge.eval.v1 import eval_pb2, eval_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from forge_experiments.canary import LATENCY_BUCKETS
from forge_kit.events import ensure_topics
from forge_kit.grpckit import make_channel
from forge_kit.http import HttpServer
from forge_kit.paths import data_dir
from forge_kit.testing import ServiceProcess, TansuBroker, TemporalDevServer, base_env, free_port
from forge_kit.testing.fault_proxy import FaultProxy

EVAL_TOKEN = "faults-promo-eval-token"
GATEWAY_TOKEN = "faults-promo-gateway-token"
ORCHESTRATOR_TOKEN = "faults-promo-orchestrator-token"
MODEL = "tiny"
VERSIONS = ("same", "errs", "quiet")  # the candidates each scenario releases after "base"
#: A window long enough that an identical canary is promoted within it on a loaded machine.
WINDOW_S, EXTENSION_S, INTERVAL_S = 10, 2, 0.5
POLICY = f"""family: {MODEL}
version: 1
traffic_percent: 25
window_s: {WINDOW_S}
interval_s: {INTERVAL_S}
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
    for line in (data_dir() / "benchmarks" / "gsm8k" / "test.jsonl").read_text().splitlines():
        row = json.loads(line)
        answers[row["question"]] = row["answer"].split("####")[-1].strip()
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        versions = ("base", *VERSIONS)
        return {"object": "list", "data": [{"id": MODEL}, *({"id": f"{MODEL}:{v}"} for v in versions)]}

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
                    self.requests.labels(t.canary, "canary", "500").inc()
                    continue
                self.requests.labels(t.canary, "canary", "200").inc()
                self.ttft.labels(t.canary, "canary").observe(self.rng.lognormvariate(-3.2, 0.2))


@dataclass
class PromotionRig:
    root: Path
    broker: TansuBroker
    link: FaultProxy
    temporal: TemporalDevServer
    evals: ServiceProcess
    gateway: ServiceProcess
    orchestrator: ServiceProcess
    endpoint: HttpServer
    exposition: HttpServer
    metrics: GatewayMetrics
    started: list[ServiceProcess] = field(default_factory=list)

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.endpoint.port}"

    def gateway_aliases(self) -> dict[str, tuple[str, str, int]]:
        """alias → (stable version, canary version, canary weight), from the gateway's table."""
        (database,) = (self.root / "gateway").glob("*.db")
        with sqlite3.connect(database) as conn:
            rows = conn.execute(
                "SELECT alias, model_name, model_version, canary_model_version, canary_weight FROM model_aliases"
            ).fetchall()
        return {
            str(a): (str(v) if n == MODEL else f"{n}:{v}", str(cv or ""), int(w or 0))
            for a, n, v, cv, w in rows
        }

    async def holders(self) -> dict[str, str]:
        """stage → the version the registry has there (canary, production)."""
        found = {}
        async with make_channel(self.evals.grpc_target, token=EVAL_TOKEN) as channel:
            stub = eval_pb2_grpc.EvalServiceStub(channel)
            for stage in ("canary", "production"):
                reply = await stub.ListModels(eval_pb2.ListModelsRequest(stage=stage), timeout=30)
                if reply.models:
                    found[stage] = reply.models[0].ref.version
        return found

    async def stage_events(self) -> list[eval_pb2.StageEvent]:
        async with make_channel(self.evals.grpc_target, token=EVAL_TOKEN) as channel:
            reply = await eval_pb2_grpc.EvalServiceStub(channel).ListStageEvents(
                eval_pb2.ListStageEventsRequest(model_name=MODEL, page=common_pb2.PageRequest(page_size=500)),
                timeout=30,
            )
        return sorted(reply.events, key=lambda e: e.event_id)


def _service(root: Path, name: str, env: dict[str, str]) -> ServiceProcess:
    return ServiceProcess(f"forge_{name}", env=env, cwd=str(root), log_path=str(root / f"{name}.log"))


async def start_rig(root: Path, clock_env: dict[str, str]) -> PromotionRig:
    proxy_port = free_port()
    broker = TansuBroker(log_path=str(root / "tansu.log"), advertised_port=proxy_port).start()
    link = FaultProxy(("127.0.0.1", broker.port), port=proxy_port, name="broker").start()
    rig_parts: list[ServiceProcess] = []
    await ensure_topics(f"127.0.0.1:{proxy_port}")
    temporal = TemporalDevServer(db_file=str(root / "temporal.db"), log_path=str(root / "temporal.log"))
    await asyncio.to_thread(temporal.start)
    kafka = f"127.0.0.1:{proxy_port}"
    evals = _service(
        root,
        "eval",
        base_env(
            "eval",
            token=EVAL_TOKEN,
            data_dir=root / "eval",
            kafka=kafka,
            grpc_port=free_port(),
            benchmarks_dir=str(data_dir() / "benchmarks"),
            response_cache_path=str(root / "eval" / "cache.sqlite"),
        ),
    )
    gateway = _service(
        root,
        "inference_gateway",
        base_env(
            "inference_gateway",
            token=GATEWAY_TOKEN,
            data_dir=root / "gateway",
            kafka=kafka,
            grpc_port=free_port(),
        ),
    )
    for process in (evals, gateway):
        await asyncio.to_thread(process.start, 90)
        rig_parts.append(process)
    endpoint = HttpServer(answering_endpoint(), "127.0.0.1", 0)
    metrics = GatewayMetrics()
    exposition = HttpServer(metrics.app(), "127.0.0.1", 0)
    await endpoint.start()
    await exposition.start()
    (root / "policies").mkdir(exist_ok=True)
    (root / "policies" / f"{MODEL}.yaml").write_text(POLICY)
    orchestrator = ServiceProcess(
        "forge_orchestrator",
        env={
            **base_env(
                "orchestrator",
                token=ORCHESTRATOR_TOKEN,
                data_dir=root / "orchestrator",
                kafka=kafka,
                grpc_port=free_port(),
                http_port=free_port(),
                temporal_target=temporal.target,
                eval_target=evals.grpc_target,
                eval_token=EVAL_TOKEN,
                gateway_metrics_urls=json.dumps([f"http://127.0.0.1:{exposition.port}/metrics"]),
                canary_policy_dir=str(root / "policies"),
            ),
            **clock_env,
        },
        log_path=str(root / "orchestrator.log"),
    )
    await asyncio.to_thread(orchestrator.start, 90)
    rig_parts.append(orchestrator)
    return PromotionRig(
        root, broker, link, temporal, evals, gateway, orchestrator, endpoint, exposition, metrics, rig_parts
    )


async def stop_rig(rig: PromotionRig) -> None:
    for process in reversed(rig.started):
        await asyncio.to_thread(process.stop)
    await rig.exposition.stop()
    await rig.endpoint.stop()
    rig.temporal.stop()
    rig.link.stop()
    rig.broker.stop()
