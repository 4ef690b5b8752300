"""The scheduler's gRPC surface on a real server: auth, validation errors, agent sessions."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from builders import make_job
from forge.common.v1 import common_pb2
from forge.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

from forge_kit.db import Database
from forge_kit.grpckit import FIELD_METADATA_KEY, GrpcServer, make_channel
from forge_kit.testing import eventually
from forge_kit.testing.grpcserver import grpc_test_server
from forge_scheduler.api import SchedulerApi
from forge_scheduler.scheduling import SchedulingLoop
from forge_scheduler.service import SchedulerService

pytestmark = pytest.mark.asyncio
TOKEN = "test-token"


@pytest.fixture
async def server(db: Database) -> AsyncIterator[GrpcServer]:
    service = SchedulerService(db)
    api = SchedulerApi(service, heartbeat_interval_s=1, max_page_size=100)
    loop = asyncio.create_task(SchedulingLoop(service, interval_s=0.2).run())
    async with grpc_test_server(
        scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server,
        api,
        "forge.scheduler.v1.SchedulerService",
        token=TOKEN,
        service="scheduler",
        authenticators=[service.teams.authenticate],
    ) as started:
        yield started
    loop.cancel()
    await asyncio.gather(loop, return_exceptions=True)


@pytest.fixture
async def stub(server: GrpcServer) -> AsyncIterator[scheduler_pb2_grpc.SchedulerServiceStub]:
    async with make_channel(f"127.0.0.1:{server.port}", token=TOKEN) as channel:
        yield scheduler_pb2_grpc.SchedulerServiceStub(channel)


async def test_call_without_token_is_unauthenticated(server: GrpcServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await scheduler_pb2_grpc.SchedulerServiceStub(channel).ListTeams(scheduler_pb2.ListTeamsRequest())
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_invalid_job_names_the_field(stub: scheduler_pb2_grpc.SchedulerServiceStub) -> None:
    await stub.CreateTeam(scheduler_pb2.CreateTeamRequest(name="research"))
    bad = make_job().priority("urgent").build()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=bad))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("spec.priority_class:")
    assert (FIELD_METADATA_KEY, "spec.priority_class") in tuple(caught.value.trailing_metadata() or ())


async def test_submit_get_list_and_page(stub: scheduler_pb2_grpc.SchedulerServiceStub) -> None:
    await stub.CreateTeam(scheduler_pb2.CreateTeamRequest(name="research"))
    ids = [
        (await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=make_job(f"j{i}").build()))).job.id
        for i in range(3)
    ]
    got = await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=ids[0]))
    assert got.job.spec.name == "j0" and got.job.state == common_pb2.JOB_STATE_PENDING
    page1 = await stub.ListJobs(
        scheduler_pb2.ListJobsRequest(team="research", page=common_pb2.PageRequest(page_size=2))
    )
    page2 = await stub.ListJobs(
        scheduler_pb2.ListJobsRequest(
            team="research", page=common_pb2.PageRequest(page_size=2, page_token=page1.page.next_page_token)
        )
    )
    assert {j.id for j in [*page1.jobs, *page2.jobs]} == set(ids) and page2.page.next_page_token == ""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.GetJob(scheduler_pb2.GetJobRequest(job_id="job-missing"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_agent_session_receives_start_and_reports_job(
    stub: scheduler_pb2_grpc.SchedulerServiceStub,
) -> None:
    quota = scheduler_pb2.Quota(gpu_type="H100", guaranteed_gpus=1)
    await stub.CreateTeam(scheduler_pb2.CreateTeamRequest(name="research", quotas=[quota]))
    register = scheduler_pb2.RegisterNode(
        node_name="node-a", gpus=[common_pb2.Gpu(index=0, type="H100", memory_mb=80_000)]
    )
    call = stub.AgentSession()
    await call.write(scheduler_pb2.AgentSessionRequest(register_node=register))
    ack = await call.read()
    assert ack.register_ack.node_id.startswith("node-")
    job = (await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=make_job().gpus(1).build()))).job
    command = await asyncio.wait_for(call.read(), 30)
    assert command.start_job.job.id == job.id and list(command.start_job.gpu_indices) == [0]
    update = scheduler_pb2.JobStatusUpdate(job_id=job.id, state=common_pb2.JOB_STATE_RUNNING)
    await call.write(scheduler_pb2.AgentSessionRequest(job_status_update=update))

    async def running() -> scheduler_pb2.Job | None:
        got = (await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job.id))).job
        return got if got.state == common_pb2.JOB_STATE_RUNNING else None

    got = await eventually(running, what="the job to be RUNNING")
    assert got.attempt == 1
    nodes = await stub.ListNodes(scheduler_pb2.ListNodesRequest())
    assert [(n.name, n.state, n.free_gpus) for n in nodes.nodes] == [
        ("node-a", scheduler_pb2.NODE_STATE_READY, 0)
    ]
    cluster = await stub.GetClusterStats(scheduler_pb2.GetClusterStatsRequest())
    assert (cluster.total_gpus, cluster.allocated_gpus, cluster.utilization) == (1, 1, 1.0)
    await call.done_writing()

    async def not_ready() -> bool:
        nodes = await stub.ListNodes(scheduler_pb2.ListNodesRequest())
        return nodes.nodes[0].state == scheduler_pb2.NODE_STATE_NOT_READY

    await eventually(not_ready, what="the node to be NOT_READY once its session ended")


async def test_team_tokens_act_only_for_their_team(
    server: GrpcServer, stub: scheduler_pb2_grpc.SchedulerServiceStub
) -> None:
    for name in ("research", "vision"):
        await stub.CreateTeam(scheduler_pb2.CreateTeamRequest(name=name))
    issued = await stub.IssueTeamToken(scheduler_pb2.IssueTeamTokenRequest(team="research", description="ci"))
    assert issued.token and issued.token_id
    theirs = (
        await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=make_job("theirs", team="vision").build()))
    ).job
    async with make_channel(f"127.0.0.1:{server.port}", token=issued.token) as channel:
        team = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        mine = (await team.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=make_job("mine").build()))).job
        await team.CancelJob(scheduler_pb2.CancelJobRequest(job_id=mine.id))
        denied = [
            team.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=make_job("x", team="vision").build())),
            team.ListJobs(scheduler_pb2.ListJobsRequest(team="vision")),
            team.SetQuota(
                scheduler_pb2.SetQuotaRequest(team="research", quota=scheduler_pb2.Quota(gpu_type="H100"))
            ),
            team.CreateTeam(scheduler_pb2.CreateTeamRequest(name="mine-now")),
            team.IssueTeamToken(scheduler_pb2.IssueTeamTokenRequest(team="research")),
        ]
        for call in denied:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call
            assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED, caught.value.details()
        # another team's job answers as a missing one; listing shows the own team's only
        for hidden in (
            team.GetJob(scheduler_pb2.GetJobRequest(job_id=theirs.id)),
            team.CancelJob(scheduler_pb2.CancelJobRequest(job_id=theirs.id)),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await hidden
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND, caught.value.details()
        listed = await team.ListJobs(scheduler_pb2.ListJobsRequest())
        assert [j.spec.name for j in listed.jobs] == ["mine"]
    # nothing was half-written by the refusals
    jobs = await stub.ListJobs(scheduler_pb2.ListJobsRequest(team="vision"))
    assert [(j.spec.name, j.state) for j in jobs.jobs] == [("theirs", common_pb2.JOB_STATE_PENDING)]
    teams = await stub.ListTeams(scheduler_pb2.ListTeamsRequest())
    assert [t.name for t in teams.teams] == ["research", "vision"]


async def test_unknown_team_is_not_found_and_never_fitting_job_is_refused(
    stub: scheduler_pb2_grpc.SchedulerServiceStub,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=make_job(team="nobody").build()))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    await stub.CreateTeam(scheduler_pb2.CreateTeamRequest(name="research"))
    call = stub.AgentSession()
    register = scheduler_pb2.RegisterNode(
        node_name="node-a", gpus=[common_pb2.Gpu(index=i, type="H100") for i in range(8)]
    )
    await call.write(scheduler_pb2.AgentSessionRequest(register_node=register))
    await call.read()
    too_big = make_job().gpus(8).replicas(2).same_node_group().build()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=too_big))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "can never be placed" in (caught.value.details() or "")
    call.cancel()


async def test_session_must_start_with_registration(stub: scheduler_pb2_grpc.SchedulerServiceStub) -> None:
    async def requests() -> AsyncIterator[scheduler_pb2.AgentSessionRequest]:
        yield scheduler_pb2.AgentSessionRequest(heartbeat=scheduler_pb2.Heartbeat())

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in stub.AgentSession(requests()):
            pass
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
