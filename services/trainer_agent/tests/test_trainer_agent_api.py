"""The TrainerAgentService on a real gRPC server: node status and runs from the agent's store."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator

import grpc
import pytest
from forge.common.v1 import common_pb2
from forge.scheduler.v1 import scheduler_pb2
from forge.trainer.v1 import trainer_pb2, trainer_pb2_grpc

from forge_kit.grpckit import FIELD_METADATA_KEY, GrpcServer, make_channel
from forge_kit.testing.grpcserver import grpc_test_server
from forge_trainer_agent.api import TrainerAgentApi
from forge_trainer_agent.service import AgentService

TOKEN = "test-token"


@pytest.fixture
async def server(agent: AgentService) -> AsyncIterator[GrpcServer]:
    api = TrainerAgentApi(agent, max_page_size=50)
    async with grpc_test_server(
        trainer_pb2_grpc.add_TrainerAgentServiceServicer_to_server,
        api,
        "forge.trainer.v1.TrainerAgentService",
        token=TOKEN,
        service="trainer_agent",
    ) as started:
        yield started


@pytest.fixture
async def stub(server: GrpcServer) -> AsyncIterator[trainer_pb2_grpc.TrainerAgentServiceStub]:
    async with make_channel(f"127.0.0.1:{server.port}", token=TOKEN) as channel:
        yield trainer_pb2_grpc.TrainerAgentServiceStub(channel)


async def test_call_without_token_is_unauthenticated(server: GrpcServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await trainer_pb2_grpc.TrainerAgentServiceStub(channel).GetNodeStatus(
                trainer_pb2.GetNodeStatusRequest()
            )
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_node_status_and_runs_reflect_what_the_agent_runs(
    agent: AgentService, stub: trainer_pb2_grpc.TrainerAgentServiceStub, start_job, reports_until
) -> None:
    sleeper = start_job("job-live", [sys.executable, "-c", "import time; time.sleep(60)"], gpus=[0, 1])
    await agent.handle(scheduler_pb2.AgentSessionResponse(start_job=sleeper))
    await agent.handle(
        scheduler_pb2.AgentSessionResponse(start_job=start_job("job-done", [sys.executable, "-c", "pass"]))
    )
    await reports_until("job-done")

    status = await stub.GetNodeStatus(trainer_pb2.GetNodeStatusRequest())

    assert status.node_name == "node-test" and not status.connected and status.node_id == ""
    assert [(g.index, g.type, g.memory_mb) for g in status.gpus] == [(0, "H100", 81559), (1, "H100", 81559)]
    assert [(r.job_id, r.state, list(r.gpu_indices)) for r in status.running] == [
        ("job-live", common_pb2.JOB_STATE_RUNNING, [0, 1])
    ]
    assert status.running[0].run_id.startswith("run-") and status.running[0].started_at.seconds > 0

    everything = await stub.ListRuns(trainer_pb2.ListRunsRequest())
    assert [(r.job_id, r.state) for r in everything.runs] == [
        ("job-done", common_pb2.JOB_STATE_SUCCEEDED),
        ("job-live", common_pb2.JOB_STATE_RUNNING),
    ]
    assert everything.page.total_size == 2 and not everything.runs[0].HasField("last_checkpoint")
    one = await stub.ListRuns(
        trainer_pb2.ListRunsRequest(job_id="job-live", page=common_pb2.PageRequest(page_size=1))
    )
    assert [r.job_id for r in one.runs] == ["job-live"] and one.page.next_page_token == ""


async def test_bad_page_token_names_the_field(stub: trainer_pb2_grpc.TrainerAgentServiceStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.ListRuns(
            trainer_pb2.ListRunsRequest(page=common_pb2.PageRequest(page_token="not-a-token"))
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (FIELD_METADATA_KEY, "page.page_token") in tuple(caught.value.trailing_metadata() or ())
