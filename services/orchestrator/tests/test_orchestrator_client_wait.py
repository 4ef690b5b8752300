"""The workflow poll (the kit's :class:`~forge_kit.orchestrator_client.OrchestratorClient`, whose
own rules ``libs/kit/tests/test_orchestrator_client.py`` checks) rides out a GetWorkflow this
service did not answer this once (Temporal's RPC timed out on a loaded machine: UNAVAILABLE).

Seen in `forge up`: the rlhf step failed on one GetWorkflow that Temporal did not answer in time
("Timeout expired", then INTERNAL), though the workflow went on."""

from __future__ import annotations

from typing import Any

from forge.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from temporalio.service import RPCError, RPCStatusCode

from forge_kit import errors
from forge_kit.orchestrator_client import OrchestratorClient
from forge_kit.testing.grpcserver import grpc_test_server
from forge_orchestrator.service import temporal_unavailable

TOKEN = "client-wait-token"


class Flaky(orchestrator_pb2_grpc.OrchestratorServiceServicer):
    """GetWorkflow answers with ``errors_first`` (raised as the service raises them), then RUNNING
    once, then COMPLETED."""

    def __init__(self, errors_first: list[Exception]) -> None:
        self.errors_first = list(errors_first)
        self.calls = 0
        self.answered = 0

    async def GetWorkflow(self, request: Any, context: Any) -> orchestrator_pb2.GetWorkflowResponse:
        self.calls += 1
        if self.errors_first:
            raise self.errors_first.pop(0)
        self.answered += 1
        status = (
            orchestrator_pb2.WORKFLOW_STATUS_RUNNING
            if self.answered == 1
            else orchestrator_pb2.WORKFLOW_STATUS_COMPLETED
        )
        return orchestrator_pb2.GetWorkflowResponse(workflow_id=request.workflow_id, status=status)


def test_a_transient_temporal_error_is_unavailable_and_others_are_not() -> None:
    timed_out = temporal_unavailable(RPCError("Timeout expired", RPCStatusCode.CANCELLED, b""))
    assert isinstance(timed_out, errors.UnavailableError) and "retry" in timed_out.message
    other = RPCError("broken", RPCStatusCode.INTERNAL, b"")
    assert temporal_unavailable(other) is other


def _serve(servicer: Flaky) -> Any:
    return grpc_test_server(
        orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server,
        servicer,
        orchestrator_pb2.DESCRIPTOR.services_by_name["OrchestratorService"].full_name,
        token=TOKEN,
    )


async def test_wait_polls_through_unavailable_answers() -> None:
    # More UNAVAILABLE answers in a row than the channel's own retry policy absorbs (4 attempts),
    # then one DEADLINE_EXCEEDED (which the channel does not retry).
    unanswered: list[Exception] = [
        temporal_unavailable(RPCError("Timeout expired", RPCStatusCode.CANCELLED, b"")) for _ in range(5)
    ]
    servicer = Flaky([*unanswered, TimeoutError()])
    async with _serve(servicer) as server, OrchestratorClient(f"127.0.0.1:{server.port}", TOKEN) as client:
        reply = await client.wait("wf-1", timeout_s=30, poll_s=0.05)
    assert reply.status == orchestrator_pb2.WORKFLOW_STATUS_COMPLETED
    assert servicer.calls == 8  # six unanswered, RUNNING, COMPLETED
