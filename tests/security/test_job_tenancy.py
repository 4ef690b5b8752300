"""Issue 36, hole 2, from the attacker's side: a team token sees and acts on its own team's jobs
only. Before, ``GetJob`` and ``ListJobs`` had no team check: team A read team B's job spec in
full, its ``env`` (``HF_TOKEN``…) included, and listed every team's jobs.

Team A's token, against a real scheduler process (``conftest.py``) holding jobs of teams A and B:

- ``GetJob`` and ``CancelJob`` of B's job answer NOT_FOUND, as a job that does not exist;
- ``ListJobs`` lists A's jobs only (asked for B's: PERMISSION_DENIED);
- ``WatchJobs`` (initial state and later changes) shows A's jobs only;
- no answer to A carries B's env values; the admin still sees everything.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from forge.common.v1 import common_pb2
from forge.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

from forge_kit.grpckit import make_channel
from forge_kit.testing import ServiceProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SECRET = "hf_team_b_secret_value_0123456789"


def spec(team: str, name: str, env: dict[str, str]) -> scheduler_pb2.JobSpec:
    return scheduler_pb2.JobSpec(
        name=name,
        team=team,
        priority_class="normal",
        command=["true"],
        env=env,
        resources=common_pb2.ResourceRequest(gpu_count=0),
    )


@pytest.fixture
async def as_team_a(
    scheduler: ServiceProcess, team_tokens: dict[str, str]
) -> AsyncIterator[scheduler_pb2_grpc.SchedulerServiceAsyncStub]:
    async with make_channel(scheduler.grpc_target, token=team_tokens["team-a"]) as channel:
        yield scheduler_pb2_grpc.SchedulerServiceStub(channel)


async def submit(target: str, token: str, job: scheduler_pb2.JobSpec) -> scheduler_pb2.Job:
    async with make_channel(target, token=token) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        return (await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=job), timeout=10)).job


async def test_team_a_cannot_see_or_touch_team_bs_jobs(
    scheduler: ServiceProcess,
    scheduler_token: str,
    team_tokens: dict[str, str],
    as_team_a: scheduler_pb2_grpc.SchedulerServiceAsyncStub,
) -> None:
    theirs = await submit(
        scheduler.grpc_target, team_tokens["team-b"], spec("team-b", "b-job", {"HF_TOKEN": SECRET})
    )
    mine = await submit(scheduler.grpc_target, team_tokens["team-a"], spec("team-a", "a-job", {"MINE": "1"}))

    for call in (
        as_team_a.GetJob(scheduler_pb2.GetJobRequest(job_id=theirs.id), timeout=10),
        as_team_a.CancelJob(scheduler_pb2.CancelJobRequest(job_id=theirs.id), timeout=10),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND, caught.value.details()
        assert SECRET not in (caught.value.details() or "")

    listed = (await as_team_a.ListJobs(scheduler_pb2.ListJobsRequest(), timeout=10)).jobs
    assert {j.id for j in listed} == {mine.id}
    assert dict(listed[0].spec.env) == {"MINE": "1"}  # its own env comes back to its own team
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await as_team_a.ListJobs(scheduler_pb2.ListJobsRequest(team="team-b"), timeout=10)
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED

    # A watch with no filter, or naming B's job, sees A's jobs only, now and later.
    watch = as_team_a.WatchJobs(scheduler_pb2.WatchJobsRequest(send_initial=True))
    seen: list[scheduler_pb2.Job] = []

    async def read() -> None:
        async for update in watch:
            seen.append(update.job)
            if update.job.spec.name == "a-later":
                return

    reader = asyncio.create_task(read())
    await submit(
        scheduler.grpc_target, team_tokens["team-b"], spec("team-b", "b-later", {"HF_TOKEN": SECRET})
    )
    await submit(scheduler.grpc_target, team_tokens["team-a"], spec("team-a", "a-later", {}))
    await asyncio.wait_for(reader, timeout=60)
    watch.cancel()
    assert {j.spec.team for j in seen} == {"team-a"}, [j.spec.name for j in seen]
    assert all(SECRET not in str(j) for j in seen)

    # B's job is untouched, and the admin sees both teams' jobs.
    async with make_channel(scheduler.grpc_target, token=scheduler_token) as channel:
        admin = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        got = (await admin.GetJob(scheduler_pb2.GetJobRequest(job_id=theirs.id), timeout=10)).job
        assert got.state == common_pb2.JOB_STATE_PENDING and got.spec.env["HF_TOKEN"] == SECRET
        teams = {
            j.spec.team for j in (await admin.ListJobs(scheduler_pb2.ListJobsRequest(), timeout=10)).jobs
        }
        assert teams == {"team-a", "team-b"}
