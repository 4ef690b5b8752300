"""Fixtures of the security suite: the real services an attack is tried against, one set per test
module (each module attacks a platform of its own).

- ``scheduler``: a scheduler process with token auth and no broker, holding teams ``team-a`` and
  ``team-b``; ``scheduler_token`` is its admin token, ``team_tokens`` a token of each team;
- ``orchestrator``: an orchestrator process in front of it on the session's Temporal server, with
  its own task queue (``orchestrator_queue``) and admin token (``orchestrator_token``);
- ``security_root``: the module's folder for data and logs, readable by every local user (an
  unprivileged attacker's command runs from there).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from forge.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

from forge_kit.grpckit import make_channel
from forge_kit.testing import ServiceProcess, TemporalDevServer, base_env

SCHEDULER_TOKEN = "security-scheduler-token"
ORCHESTRATOR_TOKEN = "security-orchestrator-token"
TEAMS = ("team-a", "team-b")


@pytest.fixture(scope="module")
def security_root(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
    root.chmod(0o755)
    return root


@pytest.fixture(scope="module")
def scheduler_token() -> str:
    return SCHEDULER_TOKEN


@pytest.fixture(scope="module")
def orchestrator_token() -> str:
    return ORCHESTRATOR_TOKEN


@pytest.fixture(scope="module")
def scheduler(security_root: Path) -> Iterator[ServiceProcess]:
    process = ServiceProcess(
        "forge_scheduler",
        env=base_env("scheduler", token=SCHEDULER_TOKEN, data_dir=security_root / "scheduler"),
        log_path=str(security_root / "scheduler.log"),
    ).start(90)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def team_tokens(scheduler: ServiceProcess) -> dict[str, str]:
    """Each of :data:`TEAMS`, created on the scheduler, and a token of it."""

    async def issue() -> dict[str, str]:
        async with make_channel(scheduler.grpc_target, token=SCHEDULER_TOKEN) as channel:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
            issued = {}
            for team in TEAMS:
                await stub.CreateTeam(scheduler_pb2.CreateTeamRequest(name=team), timeout=10)
                request = scheduler_pb2.IssueTeamTokenRequest(team=team)
                issued[team] = (await stub.IssueTeamToken(request, timeout=10)).token
            return issued

    return asyncio.run(issue())


@pytest.fixture(scope="module")
def orchestrator_queue() -> str:
    return f"security-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def orchestrator(
    temporal_server: TemporalDevServer,
    scheduler: ServiceProcess,
    team_tokens: dict[str, str],
    orchestrator_queue: str,
    security_root: Path,
) -> Iterator[ServiceProcess]:
    process = ServiceProcess(
        "forge_orchestrator",
        env=base_env(
            "orchestrator",
            token=ORCHESTRATOR_TOKEN,
            data_dir=security_root / "orchestrator",
            temporal_target=temporal_server.target,
            task_queue=orchestrator_queue,
            scheduler_target=scheduler.grpc_target,
            scheduler_token=SCHEDULER_TOKEN,
        ),
        log_path=str(security_root / "orchestrator.log"),
    )
    try:
        yield process.start(90)
    finally:
        process.stop()
