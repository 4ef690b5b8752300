"""Promotion rolls replicas, on real processes: the scheduler, a trainer agent (simulated ``SERVE``
GPUs), the eval service and the inference gateway on the session's Kafka broker (``ModelPromoted``
reaches the gateway as in production), the orchestrator with ``promote_deploy`` on (its
``eval_and_promote`` and ``deployment`` workflows on the Temporal dev server), and Forge's model
server on tiny Llamas, started by the agent as each version's replica jobs.

1. the first version of ``tiny`` is deployed (its replica placed by the scheduler) before it is
   promoted, and then serves ``forge-chat``;
2. the second version's replica is placed and in the gateway's pool before the canary split names
   it (sampled while the workflow deploys it); during the analysis the split sends the canary's
   share of ``forge-chat`` to that replica, and the first version's replica serves the rest;
3. an operator rolls the canary back: the workflow drains the second version — its replica
   leaves the pool, its job is cancelled, its process is gone — and ``forge-chat`` is all first
   version again;
4. a third version, promoted by an operator during its canary: the first version (the production
   it replaced) is drained the same way, and the third serves all of ``forge-chat``;
5. promotions made outside ``eval_and_promote`` roll replicas too (the orchestrator consumes
   ``ModelPromoted``): an operator's ``forge eval rollback production`` brings the first version
   back, whose replica is placed again while the third version is drained; an operator's ``forge
   eval promote`` of a fourth version straight to production (forced: it has no eval run) places
   its replica and drains the first version.

The canary analysis is kept from deciding on its own (a window far longer than the test, more
requests than it sends) so each outcome is the operator's, and known.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from forge.common.v1 import common_pb2
from forge.eval.v1 import eval_pb2, eval_pb2_grpc
from forge.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from forge.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from google.protobuf import json_format, struct_pb2

from forge_experiments.canary_traffic import Http, serve_and_drive
from forge_kit.grpckit import make_channel
from forge_kit.http import HttpServer
from forge_kit.paths import data_dir
from forge_kit.testing import ServiceProcess, TansuBroker, TemporalDevServer, base_env, eventually
from forge_kit.testing.tiny_llama import save_tiny_llama

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.asyncio, pytest.mark.timeout(1200)]
SCHEDULER_TOKEN = "scheduler-test-token"  # the session scheduler's token (conftest)
ORCHESTRATOR_TOKEN = "orchestrator-promote-token"
GATEWAY_TOKEN = "gateway-promote-token"
EVAL_TOKEN = "eval-promote-token"
TENANT_KEY = "promote-tenant-key"
BENCHMARKS = data_dir() / "benchmarks"
WAIT_S = 300.0
VERSIONS = ("v1", "v2", "v3", "v4", "v5")
#: The analysis never decides within the test: each canary's end is an operator's.
POLICY = """family: tiny
version: 1
traffic_percent: 50
window_s: 3600
interval_s: 1
extension_s: 1
max_extensions: 0
min_requests: 1000000
alpha: 0.05
beta: 0.05
metrics:
  errors: {margin: 0.05, harm_margin: 0.0, tau: 0.10}
"""


def answering_endpoint() -> FastAPI:
    """Eval's endpoint: every version answers each GSM8K question right, so each passes the gate."""
    answers = {}
    for line in (BENCHMARKS / "gsm8k" / "test.jsonl").read_text().splitlines():
        row = json.loads(line)
        answers[row["question"]] = row["answer"].split("####")[-1].strip()
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": f"tiny:{v}"} for v in VERSIONS]}

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


@pytest.fixture(scope="module")
def platform(
    start_scheduler: Any,
    start_serving_agent: Any,
    start_serving_gateway: Any,
    kafka_broker: TansuBroker,
    temporal_server: TemporalDevServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("promotion")
    (root / "policies").mkdir()
    (root / "policies" / "tiny.yaml").write_text(POLICY)
    for i, version in enumerate(VERSIONS):
        # v5 has v4's weights: scored on the same documents, it ties with production (v4).
        save_tiny_llama(root / "checkpoints" / version, seed=min(i, 3), initializer_range=0.2)
    started: list[ServiceProcess] = []

    def start(process: ServiceProcess, timeout_s: float = 90) -> ServiceProcess:
        started.append(process)
        return process.start(timeout_s)

    try:
        # A scheduler of this module's own: its SERVE node must not linger on the session's.
        scheduler = start_scheduler(root / "scheduler")
        started.append(scheduler)
        suffix = uuid.uuid4().hex[:8]
        started.append(start_serving_agent(scheduler, root / "agent", gpus=3, node="promote-node"))
        gateway = start_serving_gateway(
            root / "gateway", token=GATEWAY_TOKEN, tenant_key=TENANT_KEY, broker=kafka_broker
        )
        started.append(gateway)
        evals = start(
            ServiceProcess(
                "forge_eval",
                env=base_env(
                    "eval",
                    token=EVAL_TOKEN,
                    data_dir=root / "eval",
                    kafka=kafka_broker.bootstrap,
                    benchmarks_dir=str(BENCHMARKS),
                    response_cache_path=str(root / "eval" / "cache.sqlite"),
                    # Release runs without an endpoint score the versions' replicas through it.
                    inference_gateway_url=gateway.http_url,
                    inference_gateway_token=TENANT_KEY,
                ),
                log_path=str(root / "eval.log"),
            )
        )
        orchestrator = start(
            ServiceProcess(
                "forge_orchestrator",
                env=base_env(
                    "orchestrator",
                    token=ORCHESTRATOR_TOKEN,
                    data_dir=root / "orchestrator",
                    # It consumes ModelPromoted: every promotion, whoever made it, rolls replicas.
                    kafka=kafka_broker.bootstrap,
                    consumer_group=f"orchestrator-{suffix}",
                    temporal_target=temporal_server.target,
                    task_queue=f"forge-promote-{suffix}",
                    scheduler_target=scheduler.grpc_target,
                    scheduler_token=SCHEDULER_TOKEN,
                    eval_target=evals.grpc_target,
                    eval_token=EVAL_TOKEN,
                    inference_gateway_url=gateway.http_url,
                    inference_gateway_token=GATEWAY_TOKEN,
                    gateway_metrics_urls=f'["{gateway.http_url}/metrics"]',
                    canary_policy_dir=str(root / "policies"),
                    deploy_forge_python=sys.executable,
                    deploy_poll_s="0.5",
                    promote_deploy="true",
                    promote_deploy_team="serving",
                    promote_deploy_gpu_type="SERVE",
                    # Torch's decode attention: each replica (a HOME of its own) would otherwise
                    # build the C++ kernel before it answers, over a minute on loaded cores.
                    promote_deploy_engine_args=(
                        '["torch_threads=1", "num_kv_blocks=64", "decode_attention=torch"]'
                    ),
                    promote_deploy_dir=str(root / "promoted"),
                    promote_deploy_ready_timeout_s=str(WAIT_S),
                ),
                log_path=str(root / "orchestrator.log"),
            )
        )
        yield {
            "root": root,
            "scheduler": scheduler,
            "eval": evals,
            "gateway": gateway,
            "orchestrator": orchestrator,
        }
    finally:
        for process in reversed(started):
            process.stop()


@pytest.fixture
async def endpoint() -> AsyncIterator[str]:
    server = HttpServer(answering_endpoint(), "127.0.0.1", 0)
    await server.start()
    yield f"http://127.0.0.1:{server.port}"
    await server.stop()


class Rig:
    """The platform's clients, in the test's event loop."""

    def __init__(self, platform: dict[str, Any], endpoint: str, channels: list[Any]) -> None:
        self.root: Path = platform["root"]
        self.gateway: ServiceProcess = platform["gateway"]
        self.endpoint = endpoint
        self.orchestrator = orchestrator_pb2_grpc.OrchestratorServiceStub(channels[0])
        self.scheduler = scheduler_pb2_grpc.SchedulerServiceStub(channels[1])
        self.eval = eval_pb2_grpc.EvalServiceStub(channels[2])
        self.eval_target: str = platform["eval"].grpc_target
        self.admin = httpx.AsyncClient(
            base_url=self.gateway.http_url, headers={"Authorization": f"Bearer {GATEWAY_TOKEN}"}, timeout=30
        )
        self.api = httpx.AsyncClient(
            base_url=self.gateway.http_url, headers={"Authorization": f"Bearer {TENANT_KEY}"}, timeout=120
        )

    async def release(self, version: str, **change: Any) -> str:
        """Start eval-and-promote of ``tiny:version`` through the orchestrator's front door."""
        params = {
            "model_name": "tiny",
            "model_version": version,
            "uri": str(self.root / "checkpoints" / version),
            "suite": "gsm8k",
            "limit": 4,
            "endpoint": self.endpoint,
            **change,
            "canary_policy": "tiny",
            "poll_s": 0.5,
            "run_timeout_s": 300,
        }
        reply = await self.orchestrator.StartWorkflow(
            orchestrator_pb2.StartWorkflowRequest(
                workflow_type="eval_and_promote",
                input=json_format.ParseDict(params, struct_pb2.Struct()),
                workflow_id=f"promote-{version}-{uuid.uuid4().hex[:6]}",
            ),
            timeout=30,
        )
        return str(reply.workflow_id)

    async def workflow(self, workflow_id: str) -> orchestrator_pb2.GetWorkflowResponse:
        return await self.orchestrator.GetWorkflow(
            orchestrator_pb2.GetWorkflowRequest(workflow_id=workflow_id), timeout=30
        )

    async def result(self, workflow_id: str) -> dict[str, Any]:
        async def done() -> dict[str, Any] | None:
            reply = await self.workflow(workflow_id)
            if reply.status == orchestrator_pb2.WORKFLOW_STATUS_RUNNING:
                return None
            assert reply.status == orchestrator_pb2.WORKFLOW_STATUS_COMPLETED, reply.error
            return json_format.MessageToDict(reply.result)

        return await eventually(done, timeout_s=WAIT_S, interval_s=0.5, what=f"{workflow_id} to end")

    async def step(self, workflow_id: str) -> str:
        reply = await self.workflow(workflow_id)
        return str(json_format.MessageToDict(reply.progress).get("step", ""))

    async def deployment(self, name: str) -> orchestrator_pb2.Deployment | None:
        listed = await self.orchestrator.ListDeployments(
            orchestrator_pb2.ListDeploymentsRequest(), timeout=30
        )
        return next((d for d in listed.deployments if d.spec.name == name), None)

    async def pool(self) -> set[str]:
        reply = await self.admin.get("/admin/v1/replicas")
        reply.raise_for_status()
        return {r["url"] for r in reply.json()["replicas"] if r.get("source") == "admin"}

    async def split(self) -> tuple[str, str, int]:
        """``forge-chat``'s stable model, its canary and the canary's weight."""
        reply = await self.admin.get("/admin/v1/aliases")
        reply.raise_for_status()
        for alias in reply.json()["aliases"]:
            if alias["alias"] == "forge-chat":
                stable = f"{alias['model']['name']}:{alias['model']['version']}"
                canary = alias.get("canary") or {}
                split = canary.get("model") or {}
                name = f"{split['name']}:{split['version']}" if split else ""
                return stable, name, int(canary.get("weight") or 0)
        return "", "", 0

    async def split_is(self, stable: str, canary: tuple[str, int] | None = None) -> bool:
        now_stable, now_canary, weight = await self.split()
        return now_stable == stable and (canary is None or (now_canary, weight) == canary)

    async def served_by(self, requests: int) -> Counter[str]:
        """Which model version answered each of ``requests`` chats (distinct users: the split is
        sticky per user)."""
        seen: Counter[str] = Counter()
        for i in range(requests):
            body = {
                "model": "forge-chat",
                "messages": [{"role": "user", "content": "To be, or not"}],
                "max_tokens": 2,
                "user": f"user-{uuid.uuid4().hex}-{i}",
            }
            reply = await self.api.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            seen[reply.headers.get("x-forge-model", "")] += 1
        return seen

    async def routed_to(self, url: str) -> float:
        """Requests the gateway sent to the replica at ``url`` (its ``forge_gateway_routed_total``)."""
        text = (await self.admin.get("/metrics")).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith("forge_gateway_routed_total{") and f'replica="{url}"' in line:
                total += float(line.rsplit(" ", 1)[1])
        return total

    async def rollback_production(self) -> None:
        """``forge eval rollback production``."""
        await self.eval.RollbackModel(
            eval_pb2.RollbackModelRequest(
                stage="production", reason="operator rollback in the promotion test"
            ),
            timeout=30,
        )

    async def promote_directly(self, version: str) -> None:
        """``forge eval register`` and ``forge eval promote --stage production --force``."""
        await self.eval.RegisterModel(
            eval_pb2.RegisterModelRequest(
                ref=common_pb2.ModelRef(name="tiny", version=version),
                uri=str(self.root / "checkpoints" / version),
            ),
            timeout=30,
        )
        await self.eval.PromoteModel(
            eval_pb2.PromoteModelRequest(
                ref=common_pb2.ModelRef(name="tiny", version=version),
                stage="production",
                reason="operator promotion in the promotion test",
                force=True,
            ),
            timeout=30,
        )

    async def decide(self, version: str, decision: str) -> None:
        await self.eval.DecideRollout(
            eval_pb2.DecideRolloutRequest(
                ref=common_pb2.ModelRef(name="tiny", version=version),
                decision=decision,
                reason=f"operator {decision} in the promotion test",
            ),
            timeout=30,
        )


@pytest.fixture
async def rig(platform: dict[str, Any], endpoint: str) -> AsyncIterator[Rig]:
    async with (
        make_channel(platform["orchestrator"].grpc_target, token=ORCHESTRATOR_TOKEN) as o,
        make_channel(platform["scheduler"].grpc_target, token=SCHEDULER_TOKEN) as s,
        make_channel(platform["eval"].grpc_target, token=EVAL_TOKEN) as e,
    ):
        rig = Rig(platform, endpoint, [o, s, e])
        yield rig
        await rig.admin.aclose()
        await rig.api.aclose()


def _pids_of(job_id: str) -> list[int]:
    """Processes started for ``job_id`` (the agent puts FORGE_JOB_ID in their environment)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"FORGE_JOB_ID={job_id}".encode() in environ:
            found.append(int(entry.name))
    return found


async def _ready_replica(rig: Rig, deployment: str) -> orchestrator_pb2.DeploymentReplica:
    async def ready() -> orchestrator_pb2.DeploymentReplica | None:
        d = await rig.deployment(deployment)
        return d.replicas[0] if d is not None and d.ready_replicas == 1 else None

    return await eventually(ready, timeout_s=WAIT_S, interval_s=0.5, what=f"{deployment} ready")


async def _drained(rig: Rig, deployment: str, replica: orchestrator_pb2.DeploymentReplica) -> None:
    """``deployment``'s replica is out of the pool, its job cancelled, its process gone and the
    deployment ended."""

    async def gone() -> bool:
        job = (await rig.scheduler.GetJob(scheduler_pb2.GetJobRequest(job_id=replica.job_id), timeout=30)).job
        return (
            replica.endpoint not in await rig.pool()
            and job.state == common_pb2.JOB_STATE_CANCELLED
            and not _pids_of(replica.job_id)
            and await rig.deployment(deployment) is None
        )

    await eventually(gone, timeout_s=WAIT_S, interval_s=0.5, what=f"{deployment} drained")


async def _canary_split_waits_for_replicas(rig: Rig, workflow_id: str, version: str) -> None:
    """Until the workflow analyses the canary: whenever the gateway splits ``forge-chat`` to the
    version, its deployment has its replica ready in the gateway's pool."""
    deployment = f"tiny-{version}"
    sampled_before_split = 0

    async def analysing() -> bool:
        nonlocal sampled_before_split
        _, canary, weight = await rig.split()
        d = await rig.deployment(deployment)
        if canary == f"tiny:{version}" and weight:
            assert d is not None and d.ready_replicas == 1, "traffic split before the replica was ready"
            assert {r.endpoint for r in d.replicas} <= await rig.pool()
        else:
            sampled_before_split += 1
        return await rig.step(workflow_id) == "canary analysis"

    await eventually(analysing, timeout_s=WAIT_S, interval_s=0.3, what=f"tiny:{version} in canary")
    assert sampled_before_split > 0


async def test_promotion_rolls_replicas_and_rollback_or_promotion_drains_the_loser(rig: Rig) -> None:
    # 1. The first version: deployed, then straight to production.
    first = await rig.result(await rig.release("v1"))
    assert first["decision"] == "promoted" and first["promoted_to"] == ["canary", "production"]
    assert first["deployment"] == "tiny-v1"
    v1 = await _ready_replica(rig, "tiny-v1")
    await eventually(lambda: rig.split_is("tiny:v1"), timeout_s=WAIT_S, what="forge-chat to name tiny:v1")
    assert await rig.served_by(4) == Counter({"tiny:v1": 4})

    # 2. The second version: its replica ready before the split names it, then it takes its share.
    second = await rig.release("v2")
    await _canary_split_waits_for_replicas(rig, second, "v2")
    v2 = await _ready_replica(rig, "tiny-v2")
    assert {v1.endpoint, v2.endpoint} <= await rig.pool() and v1.endpoint != v2.endpoint
    await eventually(
        lambda: rig.split_is("tiny:v1", ("tiny:v2", 50)), timeout_s=WAIT_S, what="forge-chat split to tiny:v2"
    )
    before = await rig.routed_to(v2.endpoint)
    seen = await rig.served_by(40)
    assert set(seen) == {"tiny:v1", "tiny:v2"} and 8 <= seen["tiny:v2"] <= 32, seen
    assert await rig.routed_to(v2.endpoint) - before >= seen["tiny:v2"]

    # 3. An operator rolls the canary back: the second version is drained.
    await rig.decide("v2", "rollback")
    rolled = await rig.result(second)
    assert rolled["decision"] == "rolled_back" and rolled["drained"] == ["tiny-v2"]
    await _drained(rig, "tiny-v2", v2)
    assert await rig.served_by(12) == Counter({"tiny:v1": 12})

    # 4. A third version promoted by an operator: the production it replaced is drained.
    third = await rig.release("v3")
    await _canary_split_waits_for_replicas(rig, third, "v3")
    v3 = await _ready_replica(rig, "tiny-v3")
    await rig.decide("v3", "promote")
    promoted = await rig.result(third)
    assert promoted["decision"] == "promoted" and promoted["promoted_to"] == ["canary", "production"]
    assert promoted["drained"] == ["tiny-v1"]
    await _drained(rig, "tiny-v1", v1)
    assert v3.endpoint in await rig.pool()
    assert await rig.served_by(12) == Counter({"tiny:v3": 12})

    # 5. Promotions made outside eval-and-promote: a production rollback restores the first version,
    # whose replica is placed again, and drains the third.
    await rig.rollback_production()
    v1_again = await _ready_replica(rig, "tiny-v1")
    assert v1_again.job_id != v1.job_id
    await _drained(rig, "tiny-v3", v3)
    await eventually(lambda: rig.split_is("tiny:v1"), timeout_s=WAIT_S, what="forge-chat back to tiny:v1")
    assert await rig.served_by(8) == Counter({"tiny:v1": 8})
    # An operator's direct promotion of a fourth version to production: placed, and the first drained.
    await rig.promote_directly("v4")
    v4 = await _ready_replica(rig, "tiny-v4")
    await _drained(rig, "tiny-v1", v1_again)
    assert v4.endpoint in await rig.pool()
    assert await rig.served_by(8) == Counter({"tiny:v4": 8})


async def test_release_runs_score_each_versions_replicas_through_the_gateway(rig: Rig) -> None:
    """With no endpoint, a release is scored on replicas, not on a model server eval starts: the
    candidate's deployment is ready before its run, and both runs (the candidate's and
    production's, v4 from the test before) go through the gateway pinned by ``name:version``, on
    the same documents with the same spec; the main job's canary traffic reaches both versions'
    replicas without loading anything."""
    assert await rig.split_is("tiny:v4")
    v4 = await _ready_replica(rig, "tiny-v4")
    before = await rig.routed_to(v4.endpoint)
    release = await rig.release("v5", endpoint="", suite="tinyshakespeare_ppl", limit=2, canary_percent=50)
    await _canary_split_waits_for_replicas(rig, release, "v5")
    v5 = await _ready_replica(rig, "tiny-v5")
    runs = {}
    for version in ("v5", "v4"):
        listed = await rig.eval.ListRuns(eval_pb2.ListRunsRequest(model_name="tiny", model_version=version))
        [run] = [r for r in listed.runs if r.suite == "tinyshakespeare_ppl"]
        runs[version] = run
    for run in runs.values():
        assert run.status == eval_pb2.RUN_STATUS_SUCCEEDED and not run.serve_model
        assert run.endpoint.rstrip("/") == rig.gateway.http_url and run.example_count == 2
    assert runs["v5"].spec_hash != "" and runs["v5"].metrics and runs["v4"].metrics
    scores = {v: {m.name: m.value for m in run.metrics} for v, run in runs.items()}
    assert scores["v5"] == pytest.approx(scores["v4"], rel=1e-4)  # the same weights, the same documents
    # Each run reached its own version's replica through the gateway.
    routed = [
        line
        for line in (await rig.admin.get("/metrics")).text.splitlines()
        if line.startswith("forge_gateway_routed_total{")
    ]
    seen = f"v5 {v5.endpoint}, v4 {v4.endpoint} (before {before}): " + " | ".join(routed)
    assert await rig.routed_to(v5.endpoint) > 0, seen
    assert await rig.routed_to(v4.endpoint) > before, seen
    # The main job's canary traffic: the gateway answers both versions from their deployments,
    # so it loads nothing anywhere (no model server is given) and chats through the split.
    sent = await serve_and_drive(
        rig.eval_target,
        EVAL_TOKEN,
        None,
        Http(rig.gateway.http_url, TENANT_KEY),
        alias="forge-chat",
        root=rig.root,
        stop=asyncio.Event(),
        max_requests=24,
        rate_per_s=20.0,
    )
    assert (sent.canary, sent.production, sent.served, sent.note) == ("tiny:v5", "tiny:v4", [], "")
    assert set(sent.answered_by) == {"tiny:v5", "tiny:v4"} and not sent.failed, sent.as_dict()
    await rig.decide("v5", "rollback")
    rolled = await rig.result(release)
    assert rolled["decision"] == "rolled_back" and rolled["drained"] == ["tiny-v5"]
    await _drained(rig, "tiny-v5", v5)
