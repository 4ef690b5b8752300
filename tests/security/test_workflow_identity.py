"""Attacker's side: the orchestrator must act with its caller's rights, not as
the scheduler admin it holds a token for.

A team token issued by the scheduler (team-a) calls the orchestrator:

- a training workflow for team-b, an interpreter of its choosing (``python``), an RLHF workflow
  with a ``work_uri`` of its choosing, an identity smuggled into the input: refused;
- a training workflow for its own team runs, and the job the scheduler gets is team-a's,
  submitted on team-a's behalf (the scheduler itself refuses an ``on_behalf_of`` that does not
  match the job's team);
- another team's workflow is invisible to it (NOT_FOUND on get and cancel).

An admin may choose the team and an absolute interpreter; nobody may pass a relative one (a job
runs in its own folder on the node, where ``.venv/bin/python`` does not exist).

Real scheduler and orchestrator processes (``conftest.py``), real Temporal dev server.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from forge.common.v1 import common_pb2
from forge.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from forge.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from google.protobuf import struct_pb2

from forge_kit.grpckit import make_channel
from forge_kit.testing import ServiceProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


@pytest.fixture
async def as_team_a(
    orchestrator: ServiceProcess, team_tokens: dict[str, str]
) -> AsyncIterator[orchestrator_pb2_grpc.OrchestratorServiceAsyncStub]:
    async with make_channel(orchestrator.grpc_target, token=team_tokens["team-a"]) as channel:
        yield orchestrator_pb2_grpc.OrchestratorServiceStub(channel)


@pytest.fixture
async def as_admin(
    orchestrator: ServiceProcess, orchestrator_token: str
) -> AsyncIterator[orchestrator_pb2_grpc.OrchestratorServiceAsyncStub]:
    async with make_channel(orchestrator.grpc_target, token=orchestrator_token) as channel:
        yield orchestrator_pb2_grpc.OrchestratorServiceStub(channel)


def start(kind: str, **data: object) -> orchestrator_pb2.StartWorkflowRequest:
    payload = struct_pb2.Struct()
    payload.update(data)
    return orchestrator_pb2.StartWorkflowRequest(workflow_type=kind, input=payload)


async def refused(
    stub: orchestrator_pb2_grpc.OrchestratorServiceAsyncStub, request: object
) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.StartWorkflow(request, timeout=30)
    return caught.value


async def job_of(
    scheduler: ServiceProcess, token: str, workflow_id: str, timeout_s: float = 60
) -> scheduler_pb2.Job:
    """The job the scheduler received from ``workflow_id`` (any team), asked with the admin ``token``."""
    deadline = time.monotonic() + timeout_s
    async with make_channel(scheduler.grpc_target, token=token) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        while True:
            jobs = (await stub.ListJobs(scheduler_pb2.ListJobsRequest(), timeout=10)).jobs
            found = [j for j in jobs if j.spec.labels.get("workflow_id") == workflow_id]
            if found:
                return found[0]
            assert time.monotonic() < deadline, f"no job from {workflow_id} within {timeout_s}s"
            await asyncio.sleep(0.2)


async def test_a_team_token_cannot_start_work_for_another_team(
    as_team_a: orchestrator_pb2_grpc.OrchestratorServiceAsyncStub,
) -> None:
    for kind in ("training", "smoke"):
        extra = {"recipe": "smoke", "gpu_type": "SIM"} if kind == "training" else {}
        error = await refused(as_team_a, start(kind, team="team-b", **extra))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED, error.details()
        assert "team-a" in (error.details() or "")


async def test_a_team_token_cannot_choose_executables_paths_or_its_identity(
    as_team_a: orchestrator_pb2_grpc.OrchestratorServiceAsyncStub,
) -> None:
    error = await refused(
        as_team_a, start("training", team="team-a", recipe="smoke", gpu_type="SIM", python="/bin/sh")
    )
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED and "needs an admin" in (error.details() or "")
    error = await refused(
        as_team_a, start("rlhf", team="team-a", policy_uri="/tmp/policy", work_uri="/etc/forge-work")
    )
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED, error.details()
    error = await refused(
        as_team_a, start("eval_and_promote", model_name="m", model_version="1", uri="/tmp/m")
    )
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED, error.details()
    error = await refused(
        as_team_a,
        start(
            "training",
            team="team-b",
            recipe="smoke",
            gpu_type="SIM",
            caller={"name": "service", "role": "admin", "team": ""},
        ),
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "input.caller" in (error.details() or "")


async def test_a_team_tokens_training_job_reaches_the_scheduler_as_its_teams(
    scheduler: ServiceProcess,
    scheduler_token: str,
    as_team_a: orchestrator_pb2_grpc.OrchestratorServiceAsyncStub,
    as_admin: orchestrator_pb2_grpc.OrchestratorServiceAsyncStub,
) -> None:
    started = await as_team_a.StartWorkflow(
        start("training", team="team-a", recipe="smoke", gpu_type="SIM"), timeout=30
    )
    job = await job_of(scheduler, scheduler_token, started.workflow_id)
    assert job.spec.team == "team-a"
    assert job.spec.command[0] == "python"
    # Its own workflow is visible to it; the admin's workflow for team-b is not.
    mine = await as_team_a.GetWorkflow(orchestrator_pb2.GetWorkflowRequest(workflow_id=started.workflow_id))
    assert mine.workflow_type == "training"
    theirs = await as_admin.StartWorkflow(
        start("training", team="team-b", recipe="smoke", gpu_type="SIM", python="/usr/bin/python3"),
        timeout=30,
    )
    assert (await job_of(scheduler, scheduler_token, theirs.workflow_id)).spec.command[
        0
    ] == "/usr/bin/python3"
    for call in (
        as_team_a.GetWorkflow(orchestrator_pb2.GetWorkflowRequest(workflow_id=theirs.workflow_id)),
        as_team_a.CancelWorkflow(orchestrator_pb2.CancelWorkflowRequest(workflow_id=theirs.workflow_id)),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    # Starting under the id of team-b's workflow does not hand it over either.
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await as_team_a.StartWorkflow(
            orchestrator_pb2.StartWorkflowRequest(
                workflow_type="training",
                workflow_id=theirs.workflow_id,
                input=start("training", team="team-a", recipe="smoke", gpu_type="SIM").input,
            ),
            timeout=30,
        )
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    for workflow_id in (started.workflow_id, theirs.workflow_id):
        await as_admin.CancelWorkflow(orchestrator_pb2.CancelWorkflowRequest(workflow_id=workflow_id))


async def test_a_relative_interpreter_is_refused_for_everyone(
    as_admin: orchestrator_pb2_grpc.OrchestratorServiceAsyncStub,
) -> None:
    error = await refused(
        as_admin, start("training", team="team-b", recipe="smoke", gpu_type="SIM", python=".venv/bin/python")
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "absolute path" in (error.details() or "")


async def test_the_scheduler_holds_an_on_behalf_of_submission_to_that_team(
    scheduler: ServiceProcess, scheduler_token: str, team_tokens: dict[str, str]
) -> None:
    spec = scheduler_pb2.JobSpec(
        name="x",
        team="team-b",
        priority_class="normal",
        command=["true"],
        resources=common_pb2.ResourceRequest(gpu_count=0),
    )
    for token in (scheduler_token, team_tokens["team-a"]):
        async with make_channel(scheduler.grpc_target, token=token) as channel:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.SubmitJob(
                    scheduler_pb2.SubmitJobRequest(spec=spec, on_behalf_of="team-a"), timeout=10
                )
            assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED, caught.value.details()
            caller = await stub.GetCaller(scheduler_pb2.GetCallerRequest(), timeout=10)
            assert (caller.role, caller.team) == (
                ("admin", "") if token == scheduler_token else ("team", "team-a")
            )
    # The orchestrator's own use: its admin token, on behalf of the job's team.
    async with make_channel(scheduler.grpc_target, token=scheduler_token) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        reply = await stub.SubmitJob(
            scheduler_pb2.SubmitJobRequest(spec=spec, on_behalf_of="team-b"), timeout=10
        )
    assert reply.job.spec.team == "team-b"
