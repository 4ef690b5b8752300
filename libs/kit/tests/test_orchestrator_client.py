"""OrchestratorClient.wait, the one poll of a workflow that the CLI and the main-job steps share:
it rides out answers that did not come this once (UNAVAILABLE, DEADLINE_EXCEEDED), waits for a
workflow another service starts to become visible only when asked to (NOT_FOUND), ends on any
other error, and gives up at its deadline. A real gRPC server (the kit's, with its error mapping)
answers in front of a scripted servicer."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from forge.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from google.protobuf import json_format, struct_pb2

from forge_kit import errors
from forge_kit.orchestrator_client import OrchestratorClient, response_to_dict, status_name
from forge_kit.testing.grpcserver import grpc_test_server

TOKEN = "client-token"
RUNNING, COMPLETED = orchestrator_pb2.WORKFLOW_STATUS_RUNNING, orchestrator_pb2.WORKFLOW_STATUS_COMPLETED


class Scripted(orchestrator_pb2_grpc.OrchestratorServiceServicer):
    """GetWorkflow raises each of ``first`` in turn (as the service raises them), then answers
    ``statuses`` in turn, the last one from then on; StartWorkflow records its input."""

    def __init__(self, first: list[Exception], statuses: list[int]) -> None:
        self.first, self.statuses = list(first), list(statuses)
        self.calls = 0
        self.started: list[tuple[str, dict[str, Any]]] = []

    async def GetWorkflow(self, request: Any, context: Any) -> orchestrator_pb2.GetWorkflowResponse:
        self.calls += 1
        if self.first:
            raise self.first.pop(0)
        status = self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]
        result = struct_pb2.Struct()
        result.update({"answer": 42})
        return orchestrator_pb2.GetWorkflowResponse(
            workflow_id=request.workflow_id, status=status, result=result if status == COMPLETED else None
        )

    async def StartWorkflow(self, request: Any, context: Any) -> orchestrator_pb2.StartWorkflowResponse:
        self.started.append((request.workflow_type, json_format.MessageToDict(request.input)))
        return orchestrator_pb2.StartWorkflowResponse(workflow_id=request.workflow_id or "wf-new")


def _serve(servicer: Scripted) -> Any:
    return grpc_test_server(
        orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server,
        servicer,
        orchestrator_pb2.DESCRIPTOR.services_by_name["OrchestratorService"].full_name,
        token=TOKEN,
    )


async def test_start_then_wait_through_unanswered_polls_to_the_result() -> None:
    # More UNAVAILABLE answers in a row than the channel's own retry policy absorbs (4 attempts),
    # then one DEADLINE_EXCEEDED (which the channel does not retry), then RUNNING, then done.
    unanswered: list[Exception] = [errors.UnavailableError("not answered this time") for _ in range(5)]
    servicer = Scripted([*unanswered, TimeoutError()], [RUNNING, COMPLETED])
    async with _serve(servicer) as server, OrchestratorClient(f"127.0.0.1:{server.port}", TOKEN) as client:
        workflow_id = await client.start("training", {"team": "a", "overrides": ["x=1"]})
        reply = await client.wait(workflow_id, timeout_s=30, poll_s=0.05)
    assert servicer.started == [("training", {"team": "a", "overrides": ["x=1"]})]
    assert servicer.calls == 8  # six unanswered, RUNNING, COMPLETED
    assert response_to_dict(reply) == {
        "workflow_id": "wf-new",
        "run_id": "",
        "workflow_type": "",
        "status": "COMPLETED",
        "result": {"answer": 42.0},
    }


async def test_a_workflow_not_found_ends_the_wait_unless_it_is_awaited_until_visible() -> None:
    missing = errors.NotFoundError("workflow 'wf-2' not found")
    servicer = Scripted([missing], [COMPLETED])
    async with _serve(servicer) as server, OrchestratorClient(f"127.0.0.1:{server.port}", TOKEN) as client:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client.wait("wf-2", timeout_s=30, poll_s=0.05)
        assert caught.value.code() is grpc.StatusCode.NOT_FOUND and servicer.calls == 1
        # Another service starts it: not visible for a few polls, then it ends.
        servicer.first = [missing, missing, missing]
        reply = await client.wait("wf-2", timeout_s=30, poll_s=0.05, until_visible=True)
    assert status_name(reply.status) == "COMPLETED" and servicer.calls == 5


async def test_other_errors_end_the_wait_at_once() -> None:
    servicer = Scripted([errors.PermissionDeniedError("not yours")], [COMPLETED])
    async with _serve(servicer) as server, OrchestratorClient(f"127.0.0.1:{server.port}", TOKEN) as client:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client.wait("wf-3", timeout_s=30, poll_s=0.05, until_visible=True)
    assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED and servicer.calls == 1


async def test_a_workflow_still_running_at_the_deadline_is_a_timeout() -> None:
    servicer = Scripted([], [RUNNING])
    async with _serve(servicer) as server, OrchestratorClient(f"127.0.0.1:{server.port}", TOKEN) as client:
        with pytest.raises(TimeoutError, match=r"wf-4 still RUNNING after 0\.3s"):
            await client.wait("wf-4", timeout_s=0.3, poll_s=0.05)
    assert servicer.calls >= 2


async def test_a_poll_still_unanswered_at_the_deadline_ends_with_its_error() -> None:
    servicer = Scripted([errors.UnavailableError("down")] * 1000, [COMPLETED])
    async with _serve(servicer) as server, OrchestratorClient(f"127.0.0.1:{server.port}", TOKEN) as client:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client.wait("wf-5", timeout_s=0.3, poll_s=0.05)
    assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
