"""The agent against a real scheduler process: registration, heartbeats, reconnection, reports."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from forge.common.v1 import common_pb2
from forge.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from forge.trainer.v1 import trainer_pb2, trainer_pb2_grpc

from forge_kit.backoff import Backoff
from forge_kit.grpckit import make_channel
from forge_kit.testing import ServiceProcess, base_env, eventually, free_port
from forge_trainer_agent.service import AgentService
from forge_trainer_agent.session import SchedulerSession

pytestmark = pytest.mark.integration
TOKEN = "it-token"


@pytest.fixture
def scheduler(tmp_path: Path) -> Iterator[ServiceProcess]:
    env = base_env(
        "scheduler",
        token=TOKEN,
        data_dir=tmp_path / "scheduler",
        grpc_port=free_port(),
        http_port=free_port(),
        heartbeat_interval_s="1",
    )
    process = ServiceProcess("forge_scheduler", env=env, log_path=str(tmp_path / "scheduler.log")).start()
    yield process
    process.stop()


@pytest.fixture
async def scheduler_stub(scheduler: ServiceProcess) -> AsyncIterator[scheduler_pb2_grpc.SchedulerServiceStub]:
    async with make_channel(scheduler.grpc_target, token=TOKEN) as channel:
        yield scheduler_pb2_grpc.SchedulerServiceStub(channel)


def node_named(
    stub: scheduler_pb2_grpc.SchedulerServiceStub, name: str, state: int
) -> Callable[[], Awaitable[Any]]:
    async def probe() -> scheduler_pb2.Node | None:
        nodes = (await stub.ListNodes(scheduler_pb2.ListNodesRequest())).nodes
        return next((n for n in nodes if n.name == name and n.state == state), None)

    return probe


async def test_agent_process_registers_its_gpus_and_goes_not_ready_when_stopped(
    scheduler: ServiceProcess, scheduler_stub: scheduler_pb2_grpc.SchedulerServiceStub, tmp_path: Path
) -> None:
    env = base_env(
        "trainer_agent",
        token=TOKEN,
        data_dir=tmp_path / "agent",
        scheduler_target=scheduler.grpc_target,
        scheduler_token=TOKEN,
        node_name="node-it",
        gpus="H100x8:81559",
        node_group="block-a",
        rack="rack-3",
        nvlink_domain="nvl-1",
        advertise_address="10.1.2.3",
    )
    agent = ServiceProcess("forge_trainer_agent", env=env, log_path=str(tmp_path / "agent.log")).start()
    try:
        node = await eventually(node_named(scheduler_stub, "node-it", scheduler_pb2.NODE_STATE_READY))
        assert [(g.index, g.type, g.memory_mb) for g in node.gpus] == [(i, "H100", 81559) for i in range(8)]
        assert (node.topology.node_group, node.topology.rack, node.topology.nvlink_domain) == (
            "block-a",
            "rack-3",
            "nvl-1",
        )
        # Where multi-node jobs whose rank 0 runs here rendezvous (their MASTER_ADDR).
        assert node.labels["forge.ai/address"] == "10.1.2.3"
        first_beat = node.last_heartbeat_at.ToNanoseconds()

        async with make_channel(agent.grpc_target, token=TOKEN) as channel:
            status = await trainer_pb2_grpc.TrainerAgentServiceStub(channel).GetNodeStatus(
                trainer_pb2.GetNodeStatusRequest()
            )
        assert status.connected and status.node_id == node.node_id and len(status.gpus) == 8

        async def heartbeat_after_registration() -> bool:
            beat = await node_named(scheduler_stub, "node-it", scheduler_pb2.NODE_STATE_READY)()
            return beat is not None and beat.last_heartbeat_at.ToNanoseconds() > first_beat

        await eventually(heartbeat_after_registration, what="a heartbeat after the registration")
    finally:
        agent.stop()

    await eventually(node_named(scheduler_stub, "node-it", scheduler_pb2.NODE_STATE_NOT_READY))


async def test_agent_reconnects_after_a_scheduler_restart_and_delivers_what_happened_meanwhile(
    scheduler: ServiceProcess,
    scheduler_stub: scheduler_pb2_grpc.SchedulerServiceStub,
    agent: AgentService,
) -> None:
    channel = make_channel(scheduler.grpc_target, token=TOKEN)
    session = SchedulerSession(agent, channel, register_timeout_s=5, backoff=Backoff(0.05, 0.3))
    task = asyncio.create_task(session.run())
    try:
        await eventually(node_named(scheduler_stub, "node-test", scheduler_pb2.NODE_STATE_READY))
        await scheduler_stub.CreateTeam(scheduler_pb2.CreateTeamRequest(name="research"))

        async def submit(name: str, command: list[str]) -> scheduler_pb2.Job:
            spec = scheduler_pb2.JobSpec(name=name, team="research", priority_class="normal", command=command)
            return (await scheduler_stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec))).job

        def job_in(job_id: str, state: int) -> Callable[[], Awaitable[bool]]:
            async def probe() -> bool:
                job = (await scheduler_stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id))).job
                return bool(job.state == state)

            return probe

        # The scheduler places jobs on the node; one run while connected arrives as SUCCEEDED.
        quick = await submit("quick", [sys.executable, "-c", "pass"])
        await eventually(job_in(quick.id, common_pb2.JOB_STATE_SUCCEEDED))
        long = await submit("long", [sys.executable, "-c", "import time; time.sleep(60)"])
        late = await submit("late", [sys.executable, "-c", "import time; time.sleep(2)"])
        await eventually(job_in(long.id, common_pb2.JOB_STATE_RUNNING))
        await eventually(job_in(late.id, common_pb2.JOB_STATE_RUNNING))

        # The scheduler crashes; a job finishes while the agent cannot tell it.
        scheduler.kill()
        await eventually(lambda: asyncio.sleep(0, result=not agent.connected))
        await eventually(lambda: asyncio.sleep(0, result=agent.running_job_ids() == [long.id]))
        assert session.sessions_opened == 1

        # It comes back on the same port: the agent re-registers with its running job and catches up.
        scheduler.start()
        await eventually(lambda: asyncio.sleep(0, result=session.sessions_opened == 2))
        node = await eventually(node_named(scheduler_stub, "node-test", scheduler_pb2.NODE_STATE_READY))
        assert list(node.running_job_ids) == [long.id]
        await eventually(job_in(late.id, common_pb2.JOB_STATE_SUCCEEDED))
        assert (
            await scheduler_stub.GetJob(scheduler_pb2.GetJobRequest(job_id=long.id))
        ).job.state == common_pb2.JOB_STATE_RUNNING
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await channel.close()

    await eventually(node_named(scheduler_stub, "node-test", scheduler_pb2.NODE_STATE_NOT_READY))
