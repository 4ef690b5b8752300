"""The ``train`` main-job step's workflow run, against a real gRPC server (the kit's) in front of a
scripted orchestrator: the step starts the ``training`` workflow with its input, waits through a
poll that was not answered, and reports the workflow's result, or fails naming how it ended."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from forge.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from google.protobuf import json_format, struct_pb2

from forge_kit import errors
from forge_kit.testing.grpcserver import grpc_test_server
from forge_trainer_agent.main_job import _run_workflow

TOKEN = "main-job-token"


@dataclass(frozen=True)
class Orchestrator:
    grpc_target: str
    http_url: str = ""
    token: str = TOKEN


class Training(orchestrator_pb2_grpc.OrchestratorServiceServicer):
    """StartWorkflow records its input; GetWorkflow is unanswered once (UNAVAILABLE), RUNNING once,
    then ends ``status`` with ``result``."""

    def __init__(self, status: int, result: dict[str, Any], error: str = "") -> None:
        self.status, self.result, self.error = status, result, error
        self.started: list[tuple[str, dict[str, Any]]] = []
        self.polls = 0

    async def StartWorkflow(self, request: Any, context: Any) -> orchestrator_pb2.StartWorkflowResponse:
        self.started.append((request.workflow_type, json_format.MessageToDict(request.input)))
        return orchestrator_pb2.StartWorkflowResponse(workflow_id="train-1")

    async def GetWorkflow(self, request: Any, context: Any) -> orchestrator_pb2.GetWorkflowResponse:
        self.polls += 1
        if self.polls == 1:
            raise errors.UnavailableError("Temporal did not answer this time")
        if self.polls == 2:
            return orchestrator_pb2.GetWorkflowResponse(
                workflow_id=request.workflow_id, status=orchestrator_pb2.WORKFLOW_STATUS_RUNNING
            )
        result = struct_pb2.Struct()
        result.update(self.result)
        return orchestrator_pb2.GetWorkflowResponse(
            workflow_id=request.workflow_id, status=self.status, result=result, error=self.error
        )


def _serve(servicer: Training) -> Any:
    return grpc_test_server(
        orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server,
        servicer,
        orchestrator_pb2.DESCRIPTOR.services_by_name["OrchestratorService"].full_name,
        token=TOKEN,
    )


async def test_the_step_starts_the_training_workflow_and_reports_its_result() -> None:
    servicer = Training(
        orchestrator_pb2.WORKFLOW_STATUS_COMPLETED, {"job_id": "job-1", "states_seen": ["RUNNING"]}
    )
    async with _serve(servicer) as server:
        result = await _run_workflow(
            Orchestrator(f"127.0.0.1:{server.port}"), {"team": "main-job", "replicas": 2}
        )
    assert servicer.started == [("training", {"team": "main-job", "replicas": 2.0})]
    assert result == {"job_id": "job-1", "states_seen": ["RUNNING"], "workflow_id": "train-1"}
    assert servicer.polls == 3  # unanswered, RUNNING, COMPLETED


async def test_a_workflow_that_failed_fails_the_step_naming_how_it_ended() -> None:
    servicer = Training(orchestrator_pb2.WORKFLOW_STATUS_FAILED, {}, error="job job-1 FAILED: exit 2")
    async with _serve(servicer) as server:
        with pytest.raises(
            RuntimeError, match="training workflow train-1 ended FAILED: job job-1 FAILED: exit 2"
        ):
            await _run_workflow(Orchestrator(f"127.0.0.1:{server.port}"), {"team": "main-job"})
