"""A workflow survives its worker being killed mid-run.

The orchestrator process (worker + consumer) is SIGKILLed while the smoke workflow sits in its
durable timer between two activities; a new process with the same settings picks the workflow
up and finishes it. The history proves the first activities ran once, and that two different
worker processes completed its workflow tasks.
"""

from __future__ import annotations

from typing import Any

import pytest
from forge.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from forge.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from google.protobuf import json_format
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client

from forge_kit.grpckit import make_channel
from forge_kit.testing import TemporalDevServer

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]


def _holding(reply: orchestrator_pb2.GetWorkflowResponse) -> bool:
    return reply.progress.fields["step"].string_value == "holding" if reply.HasField("progress") else False


def _closed(reply: orchestrator_pb2.GetWorkflowResponse) -> bool:
    return reply.status != orchestrator_pb2.WORKFLOW_STATUS_RUNNING


async def test_workflow_survives_worker_sigkill(
    start_orchestrator: Any,
    temporal_server: TemporalDevServer,
    scheduler_stub: scheduler_pb2_grpc.SchedulerServiceAsyncStub,
    poll_workflow: Any,
) -> None:
    first = start_orchestrator()
    team = f"restart-{first.env['FORGE_ORCHESTRATOR_TASK_QUEUE'][-8:]}"
    payload = json_format.ParseDict(
        {"team": team, "hold_s": 2, "timeout_s": 120}, orchestrator_pb2.StartWorkflowRequest().input
    )
    async with make_channel(first.target, token=first.token) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        started = await stub.StartWorkflow(
            orchestrator_pb2.StartWorkflowRequest(workflow_type="smoke", input=payload)
        )
        await poll_workflow(stub, started.workflow_id, _holding, timeout_s=60)

    first.process.kill()  # SIGKILL mid-timer: no graceful shutdown, no goodbye to Temporal or Kafka
    second = start_orchestrator(like=first)

    async with make_channel(second.target, token=second.token) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        reply = await poll_workflow(stub, started.workflow_id, _closed, timeout_s=180)

    assert orchestrator_pb2.WorkflowStatus.Name(reply.status) == "WORKFLOW_STATUS_COMPLETED", reply.error
    result = json_format.MessageToDict(reply.result)
    assert result["states_seen"] == ["PENDING", "CANCELLED"]
    assert result["elapsed_s"] >= 2
    # Side effect counted once: the scheduler holds exactly one job for this workflow's team.
    jobs = (await scheduler_stub.ListJobs(scheduler_pb2.ListJobsRequest(team=team))).jobs
    assert [j.id for j in jobs] == [result["job_id"]]

    client = await Client.connect(temporal_server.target)
    history = await client.get_workflow_handle(started.workflow_id).fetch_history()
    scheduled = [
        e.activity_task_scheduled_event_attributes.activity_type.name
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
    ]
    assert scheduled == ["ensure_team", "submit_job", "cancel_job"]
    workers = {
        e.workflow_task_completed_event_attributes.identity
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED
    }
    assert len(workers) == 2, workers
    assert any(e.event_type == EventType.EVENT_TYPE_TIMER_FIRED for e in history.events)
    # The restarted process resumed the consumer group and recorded the CANCELLED event.
    recorded = await second.settled_job_events(started.workflow_id, "CANCELLED")
    assert "CANCELLED" in [state for _, state in recorded]
