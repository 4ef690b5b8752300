"""gRPC servicer of ``forge.orchestrator.v1.OrchestratorService``: translation only."""

from __future__ import annotations

import datetime as dt
from typing import Any

import grpc
from forge.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from google.protobuf import json_format, struct_pb2, timestamp_pb2
from temporalio.client import WorkflowExecutionStatus

from forge_kit import errors
from forge_kit.grpckit import current_principal
from forge_orchestrator.identity import caller_of
from forge_orchestrator.service import OrchestratorService, WorkflowView

STATUS = {
    WorkflowExecutionStatus.RUNNING: orchestrator_pb2.WORKFLOW_STATUS_RUNNING,
    WorkflowExecutionStatus.COMPLETED: orchestrator_pb2.WORKFLOW_STATUS_COMPLETED,
    WorkflowExecutionStatus.FAILED: orchestrator_pb2.WORKFLOW_STATUS_FAILED,
    WorkflowExecutionStatus.CANCELED: orchestrator_pb2.WORKFLOW_STATUS_CANCELLED,
    WorkflowExecutionStatus.TERMINATED: orchestrator_pb2.WORKFLOW_STATUS_TERMINATED,
    WorkflowExecutionStatus.TIMED_OUT: orchestrator_pb2.WORKFLOW_STATUS_TIMED_OUT,
    WorkflowExecutionStatus.CONTINUED_AS_NEW: orchestrator_pb2.WORKFLOW_STATUS_CONTINUED_AS_NEW,
}


def _struct(value: dict[str, Any] | None) -> struct_pb2.Struct | None:
    if value is None:
        return None
    out = struct_pb2.Struct()
    out.update(value)
    return out


def _ts(value: dt.datetime | None) -> timestamp_pb2.Timestamp | None:
    if value is None:
        return None
    stamp = timestamp_pb2.Timestamp()
    stamp.FromDatetime(value if value.tzinfo else value.replace(tzinfo=dt.UTC))
    return stamp


def view_to_proto(view: WorkflowView) -> orchestrator_pb2.GetWorkflowResponse:
    return orchestrator_pb2.GetWorkflowResponse(
        workflow_id=view.workflow_id,
        run_id=view.run_id,
        workflow_type=view.workflow_type,
        status=STATUS.get(view.status, orchestrator_pb2.WORKFLOW_STATUS_UNSPECIFIED),
        result=_struct(view.result),
        error=view.error,
        progress=_struct(view.progress),
        started_at=_ts(view.started_at),
        closed_at=_ts(view.closed_at),
    )


class OrchestratorApi(orchestrator_pb2_grpc.OrchestratorServiceServicer):
    """Translates OrchestratorService RPCs to :class:`OrchestratorService` calls."""

    def __init__(self, service: OrchestratorService) -> None:
        self._service = service

    async def StartWorkflow(
        self, request: orchestrator_pb2.StartWorkflowRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.StartWorkflowResponse:
        try:
            data = json_format.MessageToDict(request.input) if request.HasField("input") else {}
        except (ValueError, json_format.Error) as exc:  # NaN or infinity: not JSON
            raise errors.ValidationError("input", f"must be plain JSON: {exc}") from None
        workflow_id, run_id = await self._service.start_workflow(
            request.workflow_type, data, request.workflow_id, caller_of(current_principal())
        )
        return orchestrator_pb2.StartWorkflowResponse(workflow_id=workflow_id, run_id=run_id)

    async def GetWorkflow(
        self, request: orchestrator_pb2.GetWorkflowRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.GetWorkflowResponse:
        return view_to_proto(
            await self._service.get_workflow(
                request.workflow_id, request.run_id, caller_of(current_principal())
            )
        )

    async def CancelWorkflow(
        self, request: orchestrator_pb2.CancelWorkflowRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.CancelWorkflowResponse:
        await self._service.cancel_workflow(
            request.workflow_id, request.reason, caller_of(current_principal())
        )
        return orchestrator_pb2.CancelWorkflowResponse()
