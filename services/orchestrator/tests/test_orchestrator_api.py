"""The OrchestratorService on a real gRPC server, a real Temporal dev server and an in-process
worker whose activities call the real scheduler. No consumer runs here, so job events reach a
workflow only when a test signals them itself (as the consumer would)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any, TypeAlias

import grpc
import pytest
from forge.common.v1 import common_pb2
from forge.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from forge.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from google.protobuf import json_format, struct_pb2
from temporalio.client import Client

from forge_kit.grpckit import FIELD_METADATA_KEY, GrpcServer, make_channel
from forge_kit.testing import ServiceProcess, TemporalDevServer
from forge_kit.testing.grpcserver import grpc_test_server
from forge_orchestrator.activities import SchedulerActivities
from forge_orchestrator.api import OrchestratorApi
from forge_orchestrator.grant import StartGuard, grant_key
from forge_orchestrator.inbox import JOB_EVENT_SIGNAL, JobEvent
from forge_orchestrator.service import OrchestratorService, build_worker

# Each wait below is up to 60 s on a loaded machine; a test makes up to four.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
TOKEN = "api-test-token"
Stub: TypeAlias = "orchestrator_pb2_grpc.OrchestratorServiceAsyncStub"


@pytest.fixture
async def client(temporal_server: TemporalDevServer) -> Client:
    return await Client.connect(temporal_server.target)


@pytest.fixture
async def server(
    client: Client, scheduler: ServiceProcess, scheduler_token: str
) -> AsyncIterator[GrpcServer]:
    task_queue = f"api-test-{uuid.uuid4().hex[:8]}"
    activities = SchedulerActivities(scheduler.grpc_target, scheduler_token)
    # The service's pairing: the front door signs each start, the worker's guard checks it.
    key = grant_key(TOKEN)
    api = OrchestratorApi(OrchestratorService(client, task_queue, grant_key=key))
    async with (
        build_worker(client, task_queue, activities, guard=StartGuard(client, key, [task_queue])),
        grpc_test_server(
            orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server,
            api,
            "forge.orchestrator.v1.OrchestratorService",
            token=TOKEN,
            service="orchestrator",
            default_deadline_s=10,
        ) as started,
    ):
        yield started
    await activities.close()


@pytest.fixture
async def stub(server: GrpcServer) -> AsyncIterator[Stub]:
    async with make_channel(f"127.0.0.1:{server.port}", token=TOKEN) as channel:
        yield orchestrator_pb2_grpc.OrchestratorServiceStub(channel)


def _input(**values: Any) -> struct_pb2.Struct:
    return json_format.ParseDict(values, struct_pb2.Struct())


async def _start(stub: Stub, **values: Any) -> str:
    request = orchestrator_pb2.StartWorkflowRequest(workflow_type="smoke", input=_input(**values))
    return str((await stub.StartWorkflow(request)).workflow_id)


def _step(reply: orchestrator_pb2.GetWorkflowResponse) -> str:
    return reply.progress.fields["step"].string_value if reply.HasField("progress") else ""


def _closed(reply: orchestrator_pb2.GetWorkflowResponse) -> bool:
    return reply.status != orchestrator_pb2.WORKFLOW_STATUS_RUNNING


async def test_call_without_token_is_unauthenticated(server: GrpcServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await orchestrator_pb2_grpc.OrchestratorServiceStub(channel).GetWorkflow(
                orchestrator_pb2.GetWorkflowRequest(workflow_id="x")
            )
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(
    ("request_fields", "field"),
    [
        ({"workflow_type": "training-v9"}, "workflow_type"),
        ({"workflow_type": "smoke", "input": _input(timeout_s="soon")}, "input.timeout_s"),
        ({"workflow_type": "smoke", "input": _input(teem="x")}, "input.teem"),
        ({"workflow_type": "smoke", "input": _input(timeout_s=0)}, "input.timeout_s"),
        ({"workflow_type": "smoke", "workflow_id": "has spaces"}, "workflow_id"),
        ({"workflow_type": "rlhf", "input": _input(policy_uri="", work_uri="/w")}, "input.policy_uri"),
        (
            {"workflow_type": "rlhf", "input": _input(policy_uri="/p", work_uri="/w", min_new_pairs=0)},
            "input.min_new_pairs",
        ),
        (
            {"workflow_type": "rlhf", "input": _input(policy_uri="/p", work_uri="/w", promote_tier="quick")},
            "input.promote_tier",
        ),
        (
            {"workflow_type": "rlhf", "input": _input(policy_uri="/p", work_uri="/w", kl_budget="x")},
            "input.kl_budget",
        ),
        # Found by fuzzing: a Struct number JSON cannot carry was an INTERNAL error.
        ({"workflow_type": "smoke", "input": _input(timeout_s=float("inf"))}, "input"),
    ],
)
async def test_invalid_start_names_the_field(stub: Stub, request_fields: dict[str, Any], field: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.StartWorkflow(orchestrator_pb2.StartWorkflowRequest(**request_fields))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(f"{field}:")
    assert (FIELD_METADATA_KEY, field) in tuple(caught.value.trailing_metadata() or ())


@pytest.mark.parametrize(
    ("values", "field", "message"),
    [
        # A missing field answers by name, not with the dataclass's TypeError.
        ({"recipe": "smoke"}, "input.team", "input.team: required"),
        ({"team": "t"}, "input.recipe", "input.recipe: required"),
        ({"team": "t", "recipe": "smok"}, "input.recipe", "did you mean 'smoke'?"),
        # A misspelled override key: refused before anything is queued, with the nearest key.
        (
            {"team": "t", "recipe": "smoke", "overrides": ["max_steps=5", "optim.lrr=1e-3"]},
            "input.overrides[1]",
            "'optim.lrr' is not an override key of smoke; did you mean 'optim.lr'?",
        ),
        # A key the recipe's task does not read (reward models' section on a pre-training run).
        ({"team": "t", "recipe": "smoke", "overrides": ["reward.margin=1"]}, "input.overrides[0]", "smoke"),
        (
            {"team": "t", "recipe": "smoke", "overrides": ["max_steps=ten"]},
            "input.overrides[0]",
            "must be an int",
        ),
        (
            {"team": "t", "recipe": "smoke", "overrides": ["compile=maybe"]},
            "input.overrides[0]",
            "must be a bool",
        ),
    ],
)
async def test_a_training_typo_is_refused_at_the_door(
    stub: Stub, values: dict[str, Any], field: str, message: str
) -> None:
    workflow_id = f"training-typo-{uuid.uuid4().hex[:8]}"
    request = orchestrator_pb2.StartWorkflowRequest(
        workflow_type="training", workflow_id=workflow_id, input=_input(gpu_type="SIM", **values)
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.StartWorkflow(request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(f"{field}:") and message in caught.value.details()
    assert (FIELD_METADATA_KEY, field) in tuple(caught.value.trailing_metadata() or ())
    # Nothing was started, so no job was queued.
    with pytest.raises(grpc.aio.AioRpcError) as absent:
        await stub.GetWorkflow(orchestrator_pb2.GetWorkflowRequest(workflow_id=workflow_id))
    assert absent.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_run_id_that_is_not_one_is_refused_by_field(stub: Stub) -> None:
    """Found by fuzzing: Temporal's own refusal of the run id surfaced as INTERNAL."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.GetWorkflow(orchestrator_pb2.GetWorkflowRequest(workflow_id="smoke-x", run_id=" "))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("run_id:")


async def test_unknown_workflow_is_not_found(stub: Stub) -> None:
    for call in (
        stub.GetWorkflow(orchestrator_pb2.GetWorkflowRequest(workflow_id="smoke-missing")),
        stub.CancelWorkflow(orchestrator_pb2.CancelWorkflowRequest(workflow_id="smoke-missing")),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_start_with_an_id_is_idempotent(stub: Stub, client: Client) -> None:
    workflow_id = f"smoke-idem-{uuid.uuid4().hex[:8]}"
    request = orchestrator_pb2.StartWorkflowRequest(workflow_type="smoke", workflow_id=workflow_id)
    first, second = await stub.StartWorkflow(request), await stub.StartWorkflow(request)
    assert first.workflow_id == second.workflow_id == workflow_id
    assert first.run_id == second.run_id
    await client.get_workflow_handle(workflow_id).terminate("test done")
    # Closed now: starting the same id again reports that run instead of running it twice.
    third = await stub.StartWorkflow(request)
    assert third.run_id == first.run_id
    reply = await stub.GetWorkflow(orchestrator_pb2.GetWorkflowRequest(workflow_id=workflow_id))
    assert reply.status == orchestrator_pb2.WORKFLOW_STATUS_TERMINATED and "terminated" in reply.error


async def test_rlhf_starts_on_the_rlhf_workers_queue(stub: Stub, client: Client, server: GrpcServer) -> None:
    """The loop runs on ``<queue>-rlhf`` (the RLHF worker's), not on the main worker's queue."""
    request = orchestrator_pb2.StartWorkflowRequest(
        workflow_type="rlhf", input=_input(policy_uri="/models/sft", work_uri="/shared/rlhf", min_new_pairs=8)
    )
    started = await stub.StartWorkflow(request)
    handle = client.get_workflow_handle(started.workflow_id)
    try:
        described = await handle.describe()
        assert described.workflow_type == "rlhf" and started.workflow_id.startswith("rlhf-")
        assert described.task_queue.endswith("-rlhf") and described.task_queue.startswith("api-test-")
    finally:
        await handle.terminate("test done")


async def test_missing_job_event_fails_the_workflow_with_a_clear_error(
    stub: Stub, poll_workflow: Any
) -> None:
    workflow_id = await _start(stub, timeout_s=1)
    reply = await poll_workflow(stub, workflow_id, _closed, timeout_s=60)
    assert reply.status == orchestrator_pb2.WORKFLOW_STATUS_FAILED
    assert "no PENDING event for job job-" in reply.error and "within 1s" in reply.error
    assert reply.HasField("closed_at") and not reply.HasField("result")


async def test_cancel_workflow_cancels_its_job(
    stub: Stub, scheduler_stub: scheduler_pb2_grpc.SchedulerServiceAsyncStub, poll_workflow: Any
) -> None:
    workflow_id = await _start(stub, timeout_s=600)
    waiting = await poll_workflow(
        stub, workflow_id, lambda r: _step(r) == "waiting for PENDING", timeout_s=60
    )
    job_id = waiting.progress.fields["job_id"].string_value
    job = (await scheduler_stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id))).job
    assert job.state == common_pb2.JOB_STATE_PENDING

    await stub.CancelWorkflow(orchestrator_pb2.CancelWorkflowRequest(workflow_id=workflow_id, reason="test"))
    reply = await poll_workflow(stub, workflow_id, _closed, timeout_s=60)

    assert reply.status == orchestrator_pb2.WORKFLOW_STATUS_CANCELLED
    job = (await scheduler_stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id))).job
    assert job.state == common_pb2.JOB_STATE_CANCELLED and job.message == "workflow cancelled"
    # Cancelling again is a no-op; cancelling a workflow that completed otherwise is refused.
    await stub.CancelWorkflow(orchestrator_pb2.CancelWorkflowRequest(workflow_id=workflow_id))


async def test_repeated_signals_are_applied_once(stub: Stub, client: Client, poll_workflow: Any) -> None:
    workflow_id = await _start(stub, timeout_s=600)
    waiting = await poll_workflow(
        stub, workflow_id, lambda r: _step(r) == "waiting for PENDING", timeout_s=60
    )
    job_id = waiting.progress.fields["job_id"].string_value
    handle = client.get_workflow_handle(workflow_id)

    pending = JobEvent(job_id=job_id, state="PENDING", event_id="ev-1")
    await handle.signal(
        JOB_EVENT_SIGNAL, JobEvent(job_id="job-someone-else", state="CANCELLED", event_id="ev-0")
    )
    await handle.signal(JOB_EVENT_SIGNAL, pending)
    await handle.signal(JOB_EVENT_SIGNAL, pending)  # redelivered
    await poll_workflow(
        stub, workflow_id, lambda r: _step(r) == "waiting for CANCELLED or SUCCEEDED", timeout_s=60
    )
    await handle.signal(JOB_EVENT_SIGNAL, JobEvent(job_id=job_id, state="CANCELLED", event_id="ev-2"))
    reply = await poll_workflow(stub, workflow_id, _closed, timeout_s=60)

    assert reply.status == orchestrator_pb2.WORKFLOW_STATUS_COMPLETED, reply.error
    assert json_format.MessageToDict(reply.result) == {
        "job_id": job_id,
        "states_seen": ["PENDING", "CANCELLED"],
        "elapsed_s": pytest.approx(json_format.MessageToDict(reply.result)["elapsed_s"]),
    }
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.CancelWorkflow(orchestrator_pb2.CancelWorkflowRequest(workflow_id=workflow_id))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
