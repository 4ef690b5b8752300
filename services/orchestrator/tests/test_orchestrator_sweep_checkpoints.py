"""A sweep that keeps its trials' checkpoints (what the ``cpt`` workflow measures): on the real
Temporal dev server and Optuna study, scheduler activities that record (as in the sweep's tests).

A trial keeps its job's newest published checkpoint; with ``checkpoint_wait_s`` a succeeded trial
waits for it — completing when it arrives, or without it once the wait is over — and a
checkpoint of a job that is no trial, or an older one, changes nothing.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from temporalio import activity
from temporalio.client import Client, WorkflowHandle
from temporalio.worker import Worker

from forge_kit.testing import TemporalDevServer, eventually
from forge_orchestrator.activities import CancelJobInput, SubmitJobInput
from forge_orchestrator.inbox import JOB_EVENT_SIGNAL, PROGRESS_QUERY, JobEvent
from forge_orchestrator.sweep.activities import SweepActivities
from forge_orchestrator.sweep.workflow import METRIC_SIGNAL, SweepInput, SweepWorkflow, TrialMetric
from forge_orchestrator.training.model import CHECKPOINT_SIGNAL, CheckpointInfo

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SPACE = """
name: keep
recipe: smoke
metric: {name: val_loss, mode: min}
sampler: grid
parameters:
  optim.lr: {type: categorical, values: [0.001, 0.002]}
gpu_type: SIM
budget: {trials: 2, gpu_hours: 10, max_steps: 3}
concurrency: 2
team: research
early_stopping: {rule: none}
"""


class Scheduler:
    def __init__(self) -> None:
        self.submitted: dict[str, SubmitJobInput] = {}

    @activity.defn(name="ensure_team")
    async def ensure_team(self, team: str) -> bool:
        return False

    @activity.defn(name="submit_job")
    async def submit_job(self, params: SubmitJobInput) -> str:
        job_id = f"job-{params.request_id.rsplit('-', 1)[-1]}"
        self.submitted[job_id] = params
        return job_id

    @activity.defn(name="cancel_job")
    async def cancel_job(self, params: CancelJobInput) -> str:
        return "CANCELLED"


async def signal(handle: WorkflowHandle[Any, Any], name: str, payload: object) -> None:
    await handle.signal(name, payload)


async def trials(handle: WorkflowHandle[Any, Any]) -> list[dict[str, Any]]:
    return list((await handle.query(PROGRESS_QUERY))["trials"])


async def _first_completed(handle: WorkflowHandle[Any, Any]) -> list[dict[str, Any]] | None:
    """The trials once the first completed and the second's events were handled too: the workflow
    handles its inbox in order, and completing the first awaits activities (tracking, the study)
    before the second's events come up, so a query in between sees the second still pending."""
    now = await trials(handle)
    return now if now[0]["state"] == "completed" and now[1]["state"] in ("finishing", "completed") else None


#: How long the test may take, after the second trial ended, to see the first one complete.
CHECK_S = 15


async def test_trials_wait_for_their_checkpoints_and_keep_the_newest(
    temporal_server: TemporalDevServer, tmp_path: Path
) -> None:
    client = await Client.connect(temporal_server.target)
    queue = f"keep-{uuid.uuid4().hex[:8]}"
    scheduler = Scheduler()
    sweeps = SweepActivities(f"sqlite+aiosqlite:///{tmp_path / 'orchestrator.db'}")
    worker = Worker(
        client,
        task_queue=queue,
        workflows=[SweepWorkflow],
        activities=[scheduler.ensure_team, scheduler.submit_job, scheduler.cancel_job, *sweeps.methods()],
    )
    async with worker:
        handle = await client.start_workflow(
            SweepWorkflow.run,
            # The wait outlasts the checks below (at most CHECK_S) on a busy machine.
            SweepInput(space=SPACE, team="research", final_metric_wait_s=1, checkpoint_wait_s=CHECK_S + 15),
            id=f"keep-{uuid.uuid4().hex[:8]}",
            task_queue=queue,
        )
        # Both submitted (slow on a busy machine: optuna's study, tracking).
        await eventually(lambda: len(scheduler.submitted) == 2, what="both trials' submissions")
        jobs = sorted(scheduler.submitted)
        for job in jobs:
            await signal(handle, JOB_EVENT_SIGNAL, JobEvent(job, "RUNNING", event_id=f"{job}-r"))
            await signal(handle, METRIC_SIGNAL, TrialMetric(job, 3, 1.0, event_id=f"{job}-m"))
            await signal(handle, JOB_EVENT_SIGNAL, JobEvent(job, "SUCCEEDED", event_id=f"{job}-s"))
        # The first trial's checkpoint comes (after its end), then an older one and a stray one.
        first = jobs[0]
        await signal(handle, CHECKPOINT_SIGNAL, CheckpointInfo(first, first, 3, "/ckpt/new", event_id="c1"))
        await signal(handle, CHECKPOINT_SIGNAL, CheckpointInfo(first, first, 1, "/ckpt/old", event_id="c2"))
        await signal(handle, CHECKPOINT_SIGNAL, CheckpointInfo("job-x", "job-x", 3, "/ckpt/x", event_id="c3"))
        now = await eventually(
            lambda: _first_completed(handle), timeout_s=CHECK_S, what="the first trial to complete"
        )
        assert now[0]["state"] == "completed" and now[1]["state"] == "finishing", now  # still waiting
        result = await handle.result()
    by_job = {t.job_id: t for t in result.trials}
    assert by_job[first].checkpoint_uri == "/ckpt/new" and by_job[first].checkpoint_step == 3
    # The second never got one: it completed anyway once the wait was over, with its value.
    second = by_job[jobs[1]]
    assert second.state == "completed" and second.checkpoint_uri == "" and second.final == 1.0
    assert result.ignored_metrics == 0
