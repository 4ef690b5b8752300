"""gRPC servicer of ``forge.orchestrator.v1.OrchestratorService``: translation only."""

from __future__ import annotations

import datetime as dt
from typing import Any

import grpc
from forge.common.v1 import common_pb2
from forge.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from google.protobuf import json_format, struct_pb2, timestamp_pb2
from temporalio.client import WorkflowExecutionStatus

from forge_kit import errors
from forge_kit.grpckit import current_principal
from forge_orchestrator.deploy.model import DeploymentInput, DeploymentStatus
from forge_orchestrator.deploy.service import DeploymentService
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


ENGINES = {orchestrator_pb2.ENGINE_FORGE: "forge", orchestrator_pb2.ENGINE_VLLM: "vllm"}


def deployment_from_proto(spec: orchestrator_pb2.DeploymentSpec) -> DeploymentInput:
    engine = ENGINES.get(spec.engine) if spec.engine else "forge"
    if engine is None:
        raise errors.ValidationError("spec.engine", f"unknown engine {spec.engine}")
    return DeploymentInput(
        name=spec.name,
        team=spec.team,
        model=spec.model,
        model_dir=spec.model_dir,
        engine=engine,
        min_replicas=spec.min_replicas or 1,
        max_replicas=spec.max_replicas,
        replicas=spec.replicas,
        gpu_count=spec.resources.gpu_count,
        gpu_type=spec.resources.gpu_type,
        engine_args=list(spec.engine_args),
        autoscale=spec.autoscale,
    )


def deployment_to_proto(status: DeploymentStatus) -> orchestrator_pb2.Deployment:
    spec = status.spec
    engine = {v: k for k, v in ENGINES.items()}[spec.engine]
    return orchestrator_pb2.Deployment(
        spec=orchestrator_pb2.DeploymentSpec(
            name=spec.name,
            team=spec.team,
            model=spec.model,
            model_dir=spec.model_dir,
            engine=engine,  # type: ignore[arg-type]
            min_replicas=spec.min_replicas,
            max_replicas=spec.max_replicas,
            replicas=spec.replicas,
            resources=common_pb2.ResourceRequest(gpu_count=spec.gpu_count, gpu_type=spec.gpu_type),
            engine_args=spec.engine_args,
            autoscale=spec.autoscale,
        ),
        desired_replicas=status.desired_replicas,
        ready_replicas=status.ready_replicas,
        replicas=[
            orchestrator_pb2.DeploymentReplica(
                job_id=r.job_id, state=r.state, endpoint=r.endpoint, node=r.node
            )
            for r in status.replicas
        ],
        state=status.state,
        message=status.message,
    )


class OrchestratorApi(orchestrator_pb2_grpc.OrchestratorServiceServicer):
    """Translates OrchestratorService RPCs to :class:`OrchestratorService` and
    :class:`DeploymentService` calls."""

    def __init__(self, service: OrchestratorService, deployments: DeploymentService | None = None) -> None:
        self._service = service
        self._deployments = deployments

    def _deploys(self) -> DeploymentService:
        if self._deployments is None:
            raise errors.ConflictError("deployments are not enabled on this orchestrator")
        return self._deployments

    async def Deploy(
        self, request: orchestrator_pb2.DeployRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.DeployResponse:
        status = await self._deploys().deploy(
            deployment_from_proto(request.spec), caller_of(current_principal())
        )
        return orchestrator_pb2.DeployResponse(deployment=deployment_to_proto(status))

    async def GetDeployment(
        self, request: orchestrator_pb2.GetDeploymentRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.GetDeploymentResponse:
        status = await self._deploys().get(request.name, caller_of(current_principal()))
        return orchestrator_pb2.GetDeploymentResponse(deployment=deployment_to_proto(status))

    async def ListDeployments(
        self, request: orchestrator_pb2.ListDeploymentsRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.ListDeploymentsResponse:
        found = await self._deploys().list(caller_of(current_principal()))
        return orchestrator_pb2.ListDeploymentsResponse(deployments=[deployment_to_proto(s) for s in found])

    async def ScaleDeployment(
        self, request: orchestrator_pb2.ScaleDeploymentRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.ScaleDeploymentResponse:
        status = await self._deploys().scale(request.name, request.replicas, caller_of(current_principal()))
        return orchestrator_pb2.ScaleDeploymentResponse(deployment=deployment_to_proto(status))

    async def Undeploy(
        self, request: orchestrator_pb2.UndeployRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.UndeployResponse:
        await self._deploys().undeploy(request.name, caller_of(current_principal()))
        return orchestrator_pb2.UndeployResponse()

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
