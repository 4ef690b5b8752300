"""Fixtures of the orchestrator tests: a migrated database, and for integration tests the real
scheduler and orchestrator started as processes next to the session's broker and Temporal server,
and where deployments place replicas: a trainer agent with ``SERVE`` GPUs and a gateway whose pool
is what they add."""

from __future__ import annotations

import asyncio
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from forge.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from forge.scheduler.v1 import scheduler_pb2_grpc

from forge_kit.events import ensure_topics
from forge_kit.grpckit import make_channel
from forge_kit.testing import ServiceProcess, TansuBroker, TemporalDevServer, base_env

MIGRATIONS = Path(__file__).parents[1] / "src" / "forge_orchestrator" / "migrations"
HISTORIES = Path(__file__).parent / "histories"
SCHEDULER_TOKEN = "scheduler-test-token"
ORCHESTRATOR_TOKEN = "orchestrator-test-token"


@pytest.fixture
def db_migrations() -> Path:
    """This service's migrations, for forge_kit.testing's ``db`` fixture."""
    return MIGRATIONS


@pytest.fixture(scope="session")
def start_scheduler(kafka_broker: TansuBroker) -> Callable[[Path], ServiceProcess]:
    """Starts a real scheduler with its data in the given folder, publishing its job events to the
    session's broker (the caller stops it)."""
    asyncio.run(ensure_topics(kafka_broker.bootstrap))

    def start(data: Path) -> ServiceProcess:
        return ServiceProcess(
            "forge_scheduler",
            env=base_env("scheduler", token=SCHEDULER_TOKEN, data_dir=data, kafka=kafka_broker.bootstrap),
            log_path=str(data / "scheduler.log"),
        ).start()

    return start


def _started(process: ServiceProcess, timeout_s: float) -> ServiceProcess:
    """``process`` started, or stopped (not left running) when it does not get ready."""
    try:
        return process.start(timeout_s)
    except BaseException:
        process.stop()
        raise


@pytest.fixture(scope="session")
def start_serving_agent() -> Callable[..., ServiceProcess]:
    """Starts a real trainer agent with ``gpus`` simulated ``SERVE`` GPUs on ``scheduler``, where
    deployments place their replicas (``JOB_KIND_INFERENCE`` jobs it runs as processes); its
    events go nowhere (Kafka off). Give it a scheduler of the module's own: a ``SERVE`` node left
    on the session's scheduler would take jobs that ask no GPU. The caller stops it."""

    def start(scheduler: ServiceProcess, data: Path, *, gpus: int, node: str) -> ServiceProcess:
        process = ServiceProcess(
            "forge_trainer_agent",
            env=base_env(
                "trainer_agent",
                token=SCHEDULER_TOKEN,
                data_dir=data,
                scheduler_target=scheduler.grpc_target,
                scheduler_token=SCHEDULER_TOKEN,
                node_name=f"{node}-{uuid.uuid4().hex[:6]}",
                gpus=f"SERVEx{gpus}",
                job_sandbox="",
                stop_grace_s="10",
            ),
            log_path=str(data / "agent.log"),
        )
        return _started(process, 60)

    return start


@pytest.fixture(scope="session")
def start_serving_gateway() -> Callable[..., ServiceProcess]:
    """Starts a real inference gateway with no configured replica: its pool is what deployments
    add. It consumes ``ModelPromoted`` from ``broker`` when one is given (Kafka off otherwise);
    ``settings`` are more of its settings by name (``autoscale_target_per_replica="2"``). The
    caller stops it."""

    def start(
        data: Path, *, token: str, tenant_key: str, broker: TansuBroker | None = None, **settings: str
    ) -> ServiceProcess:
        defaults = {
            "model_server_url": "",
            "bootstrap_api_key": tenant_key,
            "response_cache_ttl_s": "0",
            # A replica busy on loaded cores can take seconds to answer a scrape (the default
            # allows 1 s); a killed one still leaves at once (its connections are refused).
            "scrape_timeout_s": "10",
        }
        env = base_env(
            "inference_gateway",
            token=token,
            data_dir=data / "data",
            kafka=broker.bootstrap if broker is not None else None,
            **{**defaults, **settings},
        )
        process = ServiceProcess(
            "forge_inference_gateway", env=env, cwd=str(data), log_path=str(data / "gateway.log")
        )
        return _started(process, 60)

    return start


@pytest.fixture(scope="session")
def scheduler(
    start_scheduler: Callable[[Path], ServiceProcess], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcess]:
    """The real scheduler, publishing its job events to the session's broker."""
    process = start_scheduler(tmp_path_factory.mktemp("scheduler"))
    yield process
    process.stop()


@dataclass
class Orchestrator:
    """A running orchestrator process and how to reach and restart it."""

    process: ServiceProcess
    env: dict[str, str]
    data_dir: Path
    token: str = ORCHESTRATOR_TOKEN

    @property
    def target(self) -> str:
        return self.process.grpc_target

    def job_events(self, workflow_id: str) -> list[tuple[str, str]]:
        """(job id, state) rows the orchestrator recorded for ``workflow_id``, in arrival order."""
        with sqlite3.connect(self.data_dir / "orchestrator.db") as conn:
            rows = conn.execute(
                "SELECT job_id, state FROM job_events WHERE workflow_id = ? ORDER BY received_at",
                (workflow_id,),
            )
            return [(str(a), str(b)) for a, b in rows]

    async def settled_job_events(
        self, workflow_id: str, state: str, timeout_s: float = 60
    ) -> list[tuple[str, str]]:
        """``job_events`` once a row in ``state`` is there. The consumer signals the workflow inside
        the unit of work that records the event, so a workflow can finish just before its last
        row commits."""
        deadline = time.monotonic() + timeout_s
        while True:
            rows = self.job_events(workflow_id)
            if state in [s for _, s in rows] or time.monotonic() > deadline:
                return rows
            await asyncio.sleep(0.1)


OrchestratorFactory = Callable[..., Orchestrator]


def _spawn(
    base: Path,
    broker: TansuBroker,
    temporal: TemporalDevServer,
    scheduler: ServiceProcess,
    like: Orchestrator | None,
) -> Orchestrator:
    if like is not None:
        env, data = like.env, like.data_dir
    else:
        suffix = uuid.uuid4().hex[:8]
        data = base / f"orchestrator-{suffix}"
        env = base_env(
            "orchestrator",
            token=ORCHESTRATOR_TOKEN,
            data_dir=data,
            kafka=broker.bootstrap,
            temporal_target=temporal.target,
            task_queue=f"forge-orchestrator-{suffix}",
            consumer_group=f"orchestrator-{suffix}",
            consumer_session_timeout_ms="3000",
            scheduler_target=scheduler.grpc_target,
            scheduler_token=SCHEDULER_TOKEN,
        )
    process = ServiceProcess("forge_orchestrator", env=env, log_path=str(data / "orchestrator.log"))
    return Orchestrator(_started(process, 60), env, data)


@pytest.fixture
def start_orchestrator(
    kafka_broker: TansuBroker, temporal_server: TemporalDevServer, scheduler: ServiceProcess, tmp_path: Path
) -> Iterator[OrchestratorFactory]:
    """Starts orchestrator processes, each with its own task queue, consumer group and data;
    ``start_orchestrator(like=o)`` starts one with ``o``'s settings and data (a restart)."""
    started: list[Orchestrator] = []

    def start(like: Orchestrator | None = None) -> Orchestrator:
        started.append(_spawn(tmp_path, kafka_broker, temporal_server, scheduler, like))
        return started[-1]

    yield start
    for orchestrator in started:
        orchestrator.process.stop()


@pytest.fixture(scope="module")
def shared_orchestrator(
    kafka_broker: TansuBroker,
    temporal_server: TemporalDevServer,
    scheduler: ServiceProcess,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Orchestrator]:
    """One orchestrator process for a whole test module (its consumer joins its group once)."""
    orchestrator = _spawn(
        tmp_path_factory.mktemp("orchestrator"), kafka_broker, temporal_server, scheduler, None
    )
    yield orchestrator
    orchestrator.process.stop()


@pytest.fixture
async def scheduler_stub(
    scheduler: ServiceProcess,
) -> AsyncIterator[scheduler_pb2_grpc.SchedulerServiceAsyncStub]:
    async with make_channel(scheduler.grpc_target, token=SCHEDULER_TOKEN) as channel:
        yield scheduler_pb2_grpc.SchedulerServiceStub(channel)


async def wait_for_workflow(
    stub: orchestrator_pb2_grpc.OrchestratorServiceAsyncStub,
    workflow_id: str,
    until: Callable[[orchestrator_pb2.GetWorkflowResponse], bool],
    timeout_s: float = 60.0,
) -> orchestrator_pb2.GetWorkflowResponse:
    """Poll GetWorkflow until ``until(reply)``; fails the test with the last reply on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        reply = await stub.GetWorkflow(
            orchestrator_pb2.GetWorkflowRequest(workflow_id=workflow_id), timeout=10
        )
        if until(reply):
            return reply
        if time.monotonic() > deadline:
            pytest.fail(f"workflow {workflow_id} did not get there within {timeout_s}s: {reply}")
        await asyncio.sleep(0.2)


@pytest.fixture
def poll_workflow() -> Callable[..., object]:
    """:func:`wait_for_workflow`, for test modules (conftest is not importable)."""
    return wait_for_workflow


@pytest.fixture
def scheduler_token() -> str:
    return SCHEDULER_TOKEN


@pytest.fixture
def histories_dir() -> Path:
    return HISTORIES
