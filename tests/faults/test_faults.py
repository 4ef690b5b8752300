"""Fault injection against the real platform (Jepsen-style, small): with smoke workflows in
flight, kill or restart one component, bring it back, then count end to end — every workflow
completed, every job exists exactly once in the scheduler, every job event was applied exactly
once by the orchestrator — and print the recovery time.

The broker restart runs in ``make test``; the whole suite runs with ``make faults``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fault_platform import (
    ORCHESTRATOR_TOKEN,
    Platform,
    PrivatePostgres,
    start_platform,
    stop_platform,
    wait_ready,
)
from forge.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from google.protobuf import struct_pb2

from forge_kit.events import ensure_topics
from forge_kit.grpckit import make_channel
from forge_kit.testing import ServiceProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
WORKFLOWS = 4


async def run_workload(platform: Platform, team: str, fault: Callable[[], float]) -> float:
    """Start smoke workflows that hold their jobs queued, inject ``fault`` while they are in
    flight, and wait for all of them; returns the fault's recovery time."""
    async with make_channel(platform.orchestrator.grpc_target, token=ORCHESTRATOR_TOKEN) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        ids = []
        for _ in range(WORKFLOWS):
            data = struct_pb2.Struct()
            data.update({"team": team, "hold_s": 4.0, "timeout_s": 120.0})
            reply = await stub.StartWorkflow(
                orchestrator_pb2.StartWorkflowRequest(workflow_type="smoke", input=data), timeout=30
            )
            ids.append(reply.workflow_id)
        await asyncio.sleep(1.0)
        recovery_s = await asyncio.to_thread(fault)
    # The orchestrator itself may have been the one restarted: reconnect for the wait.
    async with make_channel(platform.orchestrator.grpc_target, token=ORCHESTRATOR_TOKEN) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        deadline = time.monotonic() + 180
        for workflow_id in ids:
            while True:
                got = await stub.GetWorkflow(
                    orchestrator_pb2.GetWorkflowRequest(workflow_id=workflow_id), timeout=30
                )
                if got.status != orchestrator_pb2.WORKFLOW_STATUS_RUNNING:
                    break
                assert time.monotonic() < deadline, f"{workflow_id} still running"
                await asyncio.sleep(0.5)
            assert got.status == orchestrator_pb2.WORKFLOW_STATUS_COMPLETED, (workflow_id, got.error)
    return recovery_s


def assert_nothing_lost_or_duplicated(platform: Platform, team: str) -> None:
    jobs = platform.scheduler_jobs(team)
    assert len(jobs) == WORKFLOWS, f"{len(jobs)} jobs for {WORKFLOWS} workflows"
    for state in ("PENDING", "CANCELLED"):
        # The consumer signals a workflow inside the unit of work that records the event, so a
        # workflow can end just before its last row commits: wait for the rows, then compare.
        deadline = time.monotonic() + 30
        while len(applied := [j for j in platform.job_events(state) if j in jobs]) < len(jobs):
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert sorted(applied) == sorted(jobs), f"{state}: applied {len(applied)} for {len(jobs)} jobs"


def _restart_process(process: ServiceProcess) -> float:
    process.kill()
    killed = time.monotonic()
    process.start()
    wait_ready(process)
    return time.monotonic() - killed


def _report(name: str, seconds: float) -> None:
    print(f"\nfault {name}: recovered in {seconds:.1f}s")


@pytest.mark.asyncio
async def test_broker_restart_loses_no_job_event(platform: Platform) -> None:
    """The memory-only broker forgets every record; catch-up from the scheduler's outbox and
    the outbox relay's retries make up for it."""
    team = f"fault-broker-{uuid.uuid4().hex[:6]}"

    def restart_broker() -> float:
        platform.broker.stop()
        stopped = time.monotonic()
        platform.broker.start()
        asyncio.run(ensure_topics(platform.broker.bootstrap))
        return time.monotonic() - stopped

    recovery = await run_workload(platform, team, restart_broker)
    assert_nothing_lost_or_duplicated(platform, team)
    _report("broker restart", recovery)


@pytest.mark.faults_full
@pytest.mark.asyncio
async def test_scheduler_kill_loses_no_job(platform: Platform) -> None:
    team = f"fault-sched-{uuid.uuid4().hex[:6]}"
    recovery = await run_workload(platform, team, lambda: _restart_process(platform.scheduler))
    assert_nothing_lost_or_duplicated(platform, team)
    _report("scheduler kill -9", recovery)
    assert recovery <= 10


@pytest.mark.faults_full
@pytest.mark.asyncio
async def test_orchestrator_kill_finishes_every_workflow(platform: Platform) -> None:
    team = f"fault-orch-{uuid.uuid4().hex[:6]}"
    recovery = await run_workload(platform, team, lambda: _restart_process(platform.orchestrator))
    assert_nothing_lost_or_duplicated(platform, team)
    _report("orchestrator kill -9", recovery)
    assert recovery <= 10


@pytest.mark.faults_full
@pytest.mark.asyncio
async def test_temporal_restart_finishes_every_workflow(platform: Platform) -> None:
    team = f"fault-temporal-{uuid.uuid4().hex[:6]}"

    def restart_temporal() -> float:
        platform.temporal.stop()
        stopped = time.monotonic()
        platform.temporal.start()
        wait_ready(platform.orchestrator)
        return time.monotonic() - stopped

    recovery = await run_workload(platform, team, restart_temporal)
    assert_nothing_lost_or_duplicated(platform, team)
    _report("temporal restart", recovery)


@pytest.fixture(scope="module")
def postgres_platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Platform, PrivatePostgres]]:
    """The platform with the scheduler's state in a PostgreSQL cluster of its own."""
    if not PrivatePostgres.available():
        pytest.skip("PostgreSQL's initdb/pg_ctl are not installed")
    root = tmp_path_factory.mktemp("faults-pg")
    postgres = PrivatePostgres()
    try:
        postgres.init()
        url = postgres.create_database("scheduler")
        started = start_platform(Path(root), scheduler_env={"FORGE_SCHEDULER_DATABASE_URL": url})
    except BaseException:
        postgres.remove()
        raise
    yield started, postgres
    stop_platform(started)
    postgres.remove()


@pytest.mark.faults_full
@pytest.mark.asyncio
async def test_postgres_restart_loses_no_job(postgres_platform: tuple[Platform, PrivatePostgres]) -> None:
    """The scheduler's database crashes (immediate stop: crash recovery on start) while jobs are
    submitted, cancelled and relayed; the services ride through it on their retries."""
    platform, postgres = postgres_platform
    team = f"fault-pg-{uuid.uuid4().hex[:6]}"

    def restart_postgres() -> float:
        stopped = time.monotonic()
        postgres.restart()
        wait_ready(platform.scheduler)
        return time.monotonic() - stopped

    recovery = await run_workload(platform, team, restart_postgres)
    assert_nothing_lost_or_duplicated(platform, team)
    _report("postgresql restart", recovery)
    assert recovery <= 10
