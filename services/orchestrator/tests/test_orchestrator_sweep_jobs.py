"""A sweep whose trials are real training runs, through the real scheduler and the real consumer
handlers.

Started through :class:`OrchestratorService` (validation, the memo naming the followed metric);
trials are submitted to the real scheduler and the Optuna study is on SQLite. The test plays the
trainer agent and the broker: it runs each trial's job command exactly as an agent would
(``FORGE_RUN_DIR``, ``FORGE_JOB_ID``), and hands its state changes (``JobStateChanged``) and its
``metrics.jsonl`` lines (``TrainingMetrics``) to the orchestrator's own consumer handlers
(:class:`JobEventHandler`, :class:`MetricsHandler`), which record and signal as they do from Kafka.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import optuna
import pytest
from forge.common.v1 import common_pb2
from forge.events.v1 import events_pb2
from forge.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from temporalio.client import Client, WorkflowHandle

from forge_kit.db import Database
from forge_kit.grpckit import make_channel
from forge_kit.paths import resolve_data_path
from forge_kit.testing import ServiceProcess, TemporalDevServer
from forge_orchestrator.activities import SchedulerActivities
from forge_orchestrator.event_handlers import JobEventHandler, TemporalSignaller
from forge_orchestrator.inbox import PROGRESS_QUERY
from forge_orchestrator.service import OrchestratorService, build_worker
from forge_orchestrator.sweep.activities import SweepActivities, study_storage_url
from forge_orchestrator.sweep.metrics_handler import MetricsHandler, TemporalSweepSignaller
from forge_orchestrator.sweep.workflow import SweepResult

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        not resolve_data_path("corpora/tinyshakespeare/input.txt").is_file(),
        reason="the smoke recipe trains on the tinyshakespeare corpus (forge data fetch)",
    ),
]
SCHEDULER_TOKEN = "scheduler-test-token"  # the session scheduler's token (conftest)

SPACE = """
name: real
recipe: smoke
metric: {name: val_loss, mode: min}
sampler: grid
parameters:
  optim.lr: {type: categorical, values: [0.003, 0.001, 0.0005]}
gpu_type: SIM
budget: {trials: 3, gpu_hours: 1, max_steps: 9}
concurrency: 1
team: sweepers
early_stopping: {rule: asha, min_steps: 1, eta: 3, form: stopping}
"""


class Agent:
    """Runs each trial's job and feeds its events and metrics to the consumer handlers."""

    def __init__(
        self, handle: WorkflowHandle[Any, Any], stub: Any, db: Database, client: Client, runs: Path
    ) -> None:
        self._handle, self._stub, self._db, self._runs = handle, stub, db, runs
        self._jobs = JobEventHandler(TemporalSignaller(client))
        self._metrics = MetricsHandler(TemporalSweepSignaller(client))
        self.ran: dict[str, int] = {}
        """job id → the run's exit status."""

    async def _job_event(self, job: Any, state: int) -> None:
        event = events_pb2.JobStateChanged(job_id=job.id, state=state, labels=dict(job.spec.labels))
        event.meta.event_id = uuid.uuid4().hex
        async with self._db.session() as session:
            await self._jobs.handle(event, session)
            await session.commit()

    async def _metric_lines(self, job_id: str, path: Path) -> None:
        for line in path.read_text().splitlines() if path.exists() else []:
            row = json.loads(line)
            values = {
                k: float(v)
                for k, v in row.items()
                if k not in ("step", "time_s") and isinstance(v, int | float)
            }
            event = events_pb2.TrainingMetrics(job_id=job_id, step=int(row["step"]), values=values)
            event.meta.event_id = uuid.uuid4().hex
            async with self._db.session() as session:
                await self._metrics.handle(event, session)

    async def serve(self) -> None:
        while True:
            trials = (await self._handle.query(PROGRESS_QUERY))["trials"]
            for trial in trials:
                if trial["job_id"] and trial["job_id"] not in self.ran:
                    await self._run(trial["job_id"])
            await asyncio.sleep(0.3)

    async def _run(self, job_id: str) -> None:
        job = (await self._stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id))).job
        run_dir = self._runs / job_id
        run_dir.mkdir(parents=True)
        await self._job_event(job, common_pb2.JOB_STATE_RUNNING)
        process = await asyncio.create_subprocess_exec(
            *job.spec.command,
            cwd=run_dir,
            env={**os.environ, "FORGE_RUN_DIR": str(run_dir), "FORGE_JOB_ID": job_id},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        output, _ = await process.communicate()
        (run_dir / "job.log").write_bytes(output)
        self.ran[job_id] = process.returncode or 0
        await self._metric_lines(job_id, run_dir / "metrics.jsonl")
        done = common_pb2.JOB_STATE_FAILED if process.returncode else common_pb2.JOB_STATE_SUCCEEDED
        await self._job_event(job, done)


async def test_a_sweep_of_real_training_runs(
    temporal_server: TemporalDevServer, scheduler: ServiceProcess, db: Database, tmp_path: Path
) -> None:
    client = await Client.connect(temporal_server.target)
    queue = f"sweep-real-{uuid.uuid4().hex[:8]}"
    activities = SchedulerActivities(scheduler.grpc_target, SCHEDULER_TOKEN)
    sweeps = SweepActivities(db.url)
    service = OrchestratorService(client, queue)
    async with (
        build_worker(client, queue, activities, extra_activities=sweeps.methods(), guard=None),
        make_channel(scheduler.grpc_target, token=SCHEDULER_TOKEN) as channel,
    ):
        # This interpreter, by its absolute path (an admin may name one): a bare "python" is
        # whatever PATH finds first, which need not be the one with the training library.
        sweep_id, _ = await service.start_workflow(
            "sweep", {"space": SPACE, "team": "sweepers", "python": sys.executable}
        )
        handle = client.get_workflow_handle(sweep_id, result_type=SweepResult)
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        agent = Agent(handle, stub, db, client, tmp_path / "runs")
        serving = asyncio.create_task(agent.serve())
        try:
            result = await asyncio.wait_for(handle.result(), timeout=500)
        finally:
            serving.cancel()
        jobs = {
            t.job_id: (await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=t.job_id))).job
            for t in result.trials
        }
    await activities.close()
    assert set(agent.ran.values()) == {0}, "every trial's command ran to the end"
    job = jobs[result.trials[0].job_id]
    assert job.spec.priority_class == "preemptible" and job.spec.checkpointable
    assert job.spec.labels["workflow_id"] == sweep_id and job.spec.labels["trial"] == "0"
    assert job.spec.labels["sweep_id"] == sweep_id
    # The first trial always continues; its final value is the run's val_loss at step 9.
    states = [t.state for t in result.trials]
    assert states[0] == "completed" and set(states) <= {"completed", "stopped"}, states
    assert "stopped" in states, f"lower learning rates trail at step 1 of the smoke recipe: {states}"
    final_line = [
        json.loads(ln)
        for ln in (tmp_path / "runs" / result.trials[0].job_id / "metrics.jsonl").read_text().splitlines()
    ]
    assert (
        result.trials[0].final
        == [r["val_loss"] for r in final_line if "val_loss" in r and r["step"] == 9][-1]
    )
    # Every value the workflow saw came from the run, one per evaluation (not per logged step).
    assert [int(s) for s, _ in result.trials[0].values] == list(range(0, 10)) or [
        int(s) for s, _ in result.trials[0].values
    ] == list(range(1, 10))
    for trial in result.trials:
        if trial.state == "stopped":
            assert jobs[trial.job_id].state == common_pb2.JOB_STATE_CANCELLED
    finals = [t.final for t in result.trials if t.state == "completed" and t.final is not None]
    assert result.best_metric == min(finals)
    study = optuna.load_study(study_name=sweep_id, storage=study_storage_url(db.url))
    assert len(study.trials) == 3
