from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from forge.common.v1 import common_pb2
from forge.scheduler.v1 import scheduler_pb2

from forge_kit.db import Database
from forge_trainer_agent.node import GpuInfo, NodeInfo
from forge_trainer_agent.runner import LocalProcessRunner
from forge_trainer_agent.service import AgentService, StatusReport
from forge_trainer_agent.store import RunStore

MIGRATIONS = Path(__file__).parents[1] / "src" / "forge_trainer_agent" / "migrations"
TERMINAL = {
    common_pb2.JOB_STATE_SUCCEEDED,
    common_pb2.JOB_STATE_FAILED,
    common_pb2.JOB_STATE_CANCELLED,
    common_pb2.JOB_STATE_PREEMPTED,
}

StartJobFactory = Callable[..., scheduler_pb2.StartJob]
ReportsUntil = Callable[..., Awaitable[list[StatusReport]]]


@pytest.fixture
def db_migrations() -> Path:
    """This service's migrations, for forge_kit.testing's ``db`` fixture."""
    return MIGRATIONS


@pytest.fixture
def store(db: Database) -> RunStore:
    return RunStore(db)


@pytest.fixture
def node() -> NodeInfo:
    return NodeInfo(
        name="node-test",
        gpus=(GpuInfo(0, "H100", 81559), GpuInfo(1, "H100", 81559)),
        node_group="g1",
        rack="r1",
        nvlink_domain="nv1",
    )


@pytest.fixture
async def agent(store: RunStore, node: NodeInfo, tmp_path: Path) -> AsyncIterator[AgentService]:
    service = AgentService(store, LocalProcessRunner(), node, runs_dir=tmp_path / "runs", stop_grace_s=5.0)
    yield service
    await service.shutdown(grace_s=0)


@pytest.fixture
def start_job() -> StartJobFactory:
    """Builder of StartJob commands: ``start_job("job-a", [cmd...], gpus=[0], env={...})``."""

    def build(
        job_id: str,
        command: list[str],
        *,
        attempt: int = 1,
        gpus: list[int] | None = None,
        env: dict[str, str] | None = None,
        max_runtime_s: int = 0,
        node_rank: int = 0,
        num_nodes: int = 1,
    ) -> scheduler_pb2.StartJob:
        spec = scheduler_pb2.JobSpec(
            name=job_id, team="research", command=command, env=env or {}, max_runtime_seconds=max_runtime_s
        )
        return scheduler_pb2.StartJob(
            job=scheduler_pb2.Job(id=job_id, spec=spec),
            gpu_indices=gpus or [],
            attempt=attempt,
            node_rank=node_rank,
            num_nodes=num_nodes,
            master_addr="127.0.0.1",
            master_port=29500,
        )

    return build


@pytest.fixture
def reports_until(agent: AgentService) -> ReportsUntil:
    """``await reports_until(job_id, timeout)``: the agent's reports (as its session writer would
    take them, marking each sent) up to and including a terminal state of ``job_id``."""

    async def collect(job_id: str, timeout_s: float = 10.0) -> list[StatusReport]:
        seen: list[StatusReport] = []

        async def loop() -> None:
            while True:
                agent.outbound_ready.clear()
                for report in await agent.reports():
                    seen.append(report)
                    await agent.mark_reported(report)
                    if report.job_id == job_id and report.update.state in TERMINAL:
                        return
                await agent.outbound_ready.wait()

        await asyncio.wait_for(loop(), timeout_s)
        return seen

    return collect
