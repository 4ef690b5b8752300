"""The smoke workflow across real processes: scheduler → Kafka (Tansu) → orchestrator → Temporal.

The scheduler publishes each job state change through its outbox; the orchestrator's consumer
picks it up and signals the workflow that submitted the job. Nothing in between is simulated.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from forge.common.v1 import common_pb2
from forge.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from forge.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from google.protobuf import json_format
from temporalio.client import Client
from temporalio.worker import Replayer
from typer.testing import CliRunner

from forge_kit.grpckit import make_channel
from forge_kit.testing import TemporalDevServer
from forge_orchestrator.cli import app as cli_app
from forge_orchestrator.main_job.smoke import smoke
from forge_orchestrator.service import WORKFLOWS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


@pytest.fixture
def orchestrator(shared_orchestrator: Any) -> Any:
    return shared_orchestrator


@pytest.fixture
async def stub(orchestrator: Any) -> AsyncIterator[orchestrator_pb2_grpc.OrchestratorServiceAsyncStub]:
    async with make_channel(orchestrator.target, token=orchestrator.token) as channel:
        yield orchestrator_pb2_grpc.OrchestratorServiceStub(channel)


def _completed(reply: orchestrator_pb2.GetWorkflowResponse) -> bool:
    return reply.status != orchestrator_pb2.WORKFLOW_STATUS_RUNNING


async def test_smoke_workflow_end_to_end(
    orchestrator: Any,
    stub: orchestrator_pb2_grpc.OrchestratorServiceAsyncStub,
    scheduler_stub: scheduler_pb2_grpc.SchedulerServiceAsyncStub,
    temporal_server: TemporalDevServer,
    poll_workflow: Any,
    histories_dir: Path,
) -> None:
    started = await stub.StartWorkflow(orchestrator_pb2.StartWorkflowRequest(workflow_type="smoke"))
    assert started.workflow_id.startswith("smoke-") and started.run_id

    reply = await poll_workflow(stub, started.workflow_id, _completed, timeout_s=90)

    assert orchestrator_pb2.WorkflowStatus.Name(reply.status) == "WORKFLOW_STATUS_COMPLETED", reply.error
    result = json_format.MessageToDict(reply.result)
    assert result["states_seen"] == ["PENDING", "CANCELLED"]
    assert result["elapsed_s"] > 0
    assert reply.closed_at.ToDatetime() >= reply.started_at.ToDatetime()
    # The scheduler holds the job the workflow submitted, labelled with the workflow, cancelled.
    job = (await scheduler_stub.GetJob(scheduler_pb2.GetJobRequest(job_id=result["job_id"]))).job
    assert job.state == common_pb2.JOB_STATE_CANCELLED
    assert job.spec.labels["workflow_id"] == started.workflow_id and job.spec.name.startswith("smoke-")
    # The orchestrator recorded both events it routed (its own database; the last row commits
    # just after the signal that let the workflow finish).
    assert await orchestrator.settled_job_events(started.workflow_id, "CANCELLED") == [
        (job.id, "PENDING"),
        (job.id, "CANCELLED"),
    ]

    # The recorded history replays against the current workflow code (determinism).
    client = await Client.connect(temporal_server.target)
    history = await client.get_workflow_handle(started.workflow_id).fetch_history()
    await Replayer(workflows=list(WORKFLOWS)).replay_workflow(history)
    if os.environ.get("FORGE_RECORD_HISTORIES") == "1":
        (histories_dir / "smoke.json").write_text(history.to_json())


@dataclass(frozen=True)
class _Endpoint:
    grpc_target: str
    token: str


@dataclass(frozen=True)
class _Context:
    """Shaped like forge_cli.mainjob.MainJobContext in the parts the step uses."""

    services: dict[str, _Endpoint]

    def endpoint(self, name: str) -> _Endpoint:
        return self.services[name]


async def test_main_job_step_runs_the_smoke_workflow(orchestrator: Any) -> None:
    ctx = _Context({"orchestrator": _Endpoint(orchestrator.target, orchestrator.token)})

    result = await smoke(ctx)

    assert result["ok"] is True
    assert result["states_seen"] == ["PENDING", "CANCELLED"]
    assert str(result["job_id"]).startswith("job-")
    assert await orchestrator.settled_job_events(str(result["workflow_id"]), "CANCELLED") == [
        (result["job_id"], "PENDING"),
        (result["job_id"], "CANCELLED"),
    ]


def test_cli_starts_and_gets_a_workflow(orchestrator: Any) -> None:
    env = {
        "FORGE_CLI_ORCHESTRATOR_TARGET": orchestrator.target,
        "FORGE_CLI_ORCHESTRATOR_TOKEN": orchestrator.token,
    }
    runner = CliRunner()

    started = runner.invoke(
        cli_app, ["start", "smoke", "--input", '{"team": "cli-smoke"}', "--wait", "--json"], env=env
    )
    assert started.exit_code == 0, started.output
    assert '"status": "COMPLETED"' in started.output and '"CANCELLED"' in started.output

    # Past --timeout: one line saying it still runs and how to keep waiting, exit 3; then wait on.
    running = runner.invoke(cli_app, ["start", "smoke", "--wait", "--timeout", "0"], env=env)
    assert running.exit_code == 3, running.output
    assert "still running after 0 s" in running.output and "Traceback" not in running.output
    workflow_id = running.output.split("workflow ", 1)[1].split()[0]
    assert f"forge workflows wait {workflow_id} --timeout" in running.output
    waited = runner.invoke(cli_app, ["wait", workflow_id, "--timeout", "30", "--json"], env=env)
    assert waited.exit_code == 0 and '"status": "COMPLETED"' in waited.output, waited.output

    missing = runner.invoke(cli_app, ["get", "no-such-workflow"], env=env)
    assert missing.exit_code == 1 and "NOT_FOUND" in missing.output

    bad = runner.invoke(cli_app, ["start", "smoke", "--input", '{"timeout_s": -1}'], env=env)
    assert bad.exit_code == 1 and "INVALID_ARGUMENT" in bad.output and "input.timeout_s" in bad.output
