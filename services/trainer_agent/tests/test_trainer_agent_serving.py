"""Serving jobs (``JOB_KIND_INFERENCE``): the agent assigns the replica a port, hands it over in
``FORGE_SERVE_PORT`` and in place of ``{serve_port}`` in its command and environment, and reports
the replica's URL with RUNNING (never for other jobs, never after it ended)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from forge.common.v1 import common_pb2
from forge.scheduler.v1 import scheduler_pb2

from forge_trainer_agent.node import NodeInfo
from forge_trainer_agent.runner import LocalProcessRunner
from forge_trainer_agent.service import AgentService
from forge_trainer_agent.store import RunStore

pytestmark = pytest.mark.asyncio
PRINT_PORT = "import os, sys; print(os.environ['FORGE_SERVE_PORT'], sys.argv[1], os.environ['PORT_SETTING'])"


def _job(job_id: str, kind: int) -> scheduler_pb2.AgentSessionResponse:
    spec = scheduler_pb2.JobSpec(
        name=job_id,
        team="serving",
        kind=kind,  # type: ignore[arg-type]
        command=[sys.executable, "-c", PRINT_PORT, "--port={serve_port}"],
        env={"PORT_SETTING": "{serve_port}"},
    )
    return scheduler_pb2.AgentSessionResponse(
        start_job=scheduler_pb2.StartJob(
            job=scheduler_pb2.Job(id=job_id, spec=spec), gpu_indices=[0], attempt=1
        )
    )


async def _reports(agent: AgentService, job_id: str) -> list[scheduler_pb2.JobStatusUpdate]:
    updates: list[scheduler_pb2.JobStatusUpdate] = []
    while not any(u.state == common_pb2.JOB_STATE_SUCCEEDED for u in updates):
        agent.outbound_ready.clear()
        for report in await agent.reports():
            await agent.mark_reported(report)
            if report.job_id == job_id:
                updates.append(report.update)
        if not any(u.state == common_pb2.JOB_STATE_SUCCEEDED for u in updates):
            await agent.outbound_ready.wait()
    return updates


async def test_a_serving_job_gets_a_port_and_reports_its_url(
    store: RunStore, node: NodeInfo, tmp_path: Path
) -> None:
    agent = AgentService(
        store,
        LocalProcessRunner(),
        node,
        runs_dir=tmp_path / "runs",
        advertise_address="10.1.2.3",
        ports=lambda: 41234,
    )
    try:
        await agent.handle(_job("serve-1", scheduler_pb2.JOB_KIND_INFERENCE))
        updates = await _reports(agent, "serve-1")
    finally:
        await agent.shutdown(grace_s=0)
    running = [u for u in updates if u.state == common_pb2.JOB_STATE_RUNNING]
    assert [u.endpoint for u in running] == ["http://10.1.2.3:41234"]
    assert "serving on http://10.1.2.3:41234" in running[0].message
    assert all(not u.endpoint for u in updates if u.state != common_pb2.JOB_STATE_RUNNING)
    log = (tmp_path / "runs" / "serve-1" / "attempt-1.log").read_text()
    assert log.split() == ["41234", "--port=41234", "41234"]


async def test_a_training_job_gets_no_port_and_its_command_is_left_as_written(
    store: RunStore, node: NodeInfo, tmp_path: Path
) -> None:
    code = "import os, sys; print(os.environ.get('FORGE_SERVE_PORT', 'none'), sys.argv[1])"
    agent = AgentService(store, LocalProcessRunner(), node, runs_dir=tmp_path / "runs", ports=lambda: 41234)
    command = _job("train-1", scheduler_pb2.JOB_KIND_TRAINING)
    command.start_job.job.spec.command[:] = [sys.executable, "-c", code, "{serve_port}"]
    try:
        await agent.handle(command)
        updates = await _reports(agent, "train-1")
    finally:
        await agent.shutdown(grace_s=0)
    assert all(not u.endpoint for u in updates)
    assert (tmp_path / "runs" / "train-1" / "attempt-1.log").read_text().split() == ["none", "{serve_port}"]
