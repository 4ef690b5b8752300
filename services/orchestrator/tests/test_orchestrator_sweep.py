"""The sweep workflow on the real Temporal dev server, with the real Optuna study (SQLite under the
test's tmp dir) and scheduler activities that record what they are asked (no scheduler runs the
jobs: each job's state changes and metrics are sent as the signals the Kafka consumers send).

Paths: ASHA stopping trials as their metrics arrive (each stopped job cancelled), a preempted trial
resuming and finishing (not a failure), forged and late metrics ignored, a crashing configuration
recorded as failed and never resubmitted, a silent trial timed out, and a sweep surviving its
worker's replacement mid-run.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import optuna
import pytest
from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import ApplicationError
from temporalio.worker import Replayer, Worker

from forge_experiments import sweepspace
from forge_experiments.earlystop import Asha, Budgeted, Guarded
from forge_kit import errors
from forge_kit.testing import TemporalDevServer, eventually
from forge_orchestrator.activities import CancelJobInput, SubmitJobInput
from forge_orchestrator.inbox import JOB_EVENT_SIGNAL, PROGRESS_QUERY, JobEvent
from forge_orchestrator.sweep.activities import SweepActivities
from forge_orchestrator.sweep.model import rule_of
from forge_orchestrator.sweep.service import validate_sweep
from forge_orchestrator.sweep.workflow import (
    METRIC_SIGNAL,
    SweepInput,
    SweepResult,
    SweepWorkflow,
    TrialMetric,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SPACE = """
name: unit
recipe: smoke
metric: {name: val_loss, mode: min}
sampler: grid
parameters:
  optim.lr: {type: categorical, values: [0.001, 0.002, 0.003, 0.004]}
gpu_type: SIM
budget: {trials: 4, gpu_hours: 10, max_steps: 9}
concurrency: 4
team: research
gpus_per_trial: 1
early_stopping: {rule: asha, min_steps: 1, eta: 3, form: stopping}
"""


class FakeScheduler:
    """The scheduler activities' names and types; records submissions and cancellations."""

    def __init__(self) -> None:
        self.submitted: dict[str, SubmitJobInput] = {}
        self.cancelled: list[str] = []

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
        self.cancelled.append(params.job_id)
        return "CANCELLED"


class RecordingTracker:
    def __init__(self) -> None:
        self.runs: dict[str, dict[str, Any]] = {}
        self.ended: dict[str, str] = {}
        self.metrics: dict[str, dict[str, float]] = {}

    def ensure_sweep_run(self, sweep_id: str, name: str, params: dict[str, Any]) -> str:
        self.runs.setdefault("parent", {"tags": {"forge.sweep_id": sweep_id, "forge.role": "sweep"}})
        return "parent"

    def ensure_job_run(
        self, job_id: str, *, tags: dict[str, str], params: dict[str, Any], parent_run_id: str | None = None
    ) -> str:
        self.runs.setdefault(job_id, {"tags": tags, "parent": parent_run_id})
        return f"run-{job_id}"

    def set_terminated(self, run_id: str, status: str) -> None:
        self.ended[run_id] = status

    def log_metrics(self, run_id: str, step: int, metrics: dict[str, float]) -> int:
        self.metrics.setdefault(run_id, {}).update(metrics)
        return len(metrics)


def worker_for(client: Client, queue: str, scheduler: FakeScheduler, sweeps: SweepActivities) -> Worker:
    return Worker(
        client,
        task_queue=queue,
        workflows=[SweepWorkflow],
        activities=[scheduler.ensure_team, scheduler.submit_job, scheduler.cancel_job, *sweeps.methods()],
    )


async def progress(handle: WorkflowHandle[Any, Any]) -> dict[str, Any]:
    return dict(await handle.query(PROGRESS_QUERY))


async def state_of(handle: WorkflowHandle[Any, Any], index: int) -> str:
    trials = (await progress(handle))["trials"]
    return str(trials[index]["state"]) if index < len(trials) else ""


async def event(handle: WorkflowHandle[Any, Any], job: str, state: str, reason: str = "") -> None:
    await handle.signal(JOB_EVENT_SIGNAL, JobEvent(job, state, event_id=uuid.uuid4().hex, reason=reason))


async def metric(handle: WorkflowHandle[Any, Any], job: str, step: int, value: float) -> None:
    await handle.signal(METRIC_SIGNAL, TrialMetric(job, step, value, event_id=uuid.uuid4().hex))


@pytest.fixture
async def client(temporal_server: TemporalDevServer) -> Client:
    return await Client.connect(temporal_server.target)


async def test_asha_stops_trials_preemption_resumes_and_forged_metrics_are_ignored(
    client: Client, tmp_path: Path
) -> None:
    queue = f"sweep-{uuid.uuid4().hex[:8]}"
    scheduler, tracker = FakeScheduler(), RecordingTracker()
    storage = f"sqlite+aiosqlite:///{tmp_path / 'orchestrator.db'}"
    sweeps = SweepActivities(storage, tracker)
    sweep_id = f"sweep-{uuid.uuid4().hex[:8]}"
    async with worker_for(client, queue, scheduler, sweeps):
        handle = await client.start_workflow(
            "sweep",
            SweepInput(space=SPACE, team="research"),
            id=sweep_id,
            task_queue=queue,
            result_type=SweepResult,
        )
        await eventually(lambda: asyncio.sleep(0, len(scheduler.submitted) == 4))
        jobs = [f"job-{i}" for i in range(4)]
        assert scheduler.submitted["job-2"].priority_class == "preemptible"
        assert (
            "--set" in scheduler.submitted["job-2"].command
            and "optim.lr=0.003" in scheduler.submitted["job-2"].command
        )
        for job in jobs:
            await event(handle, job, "RUNNING")
        # Rung 1 (eta 3): a=5.0 continues, b=4.0 continues, c=6.0 and d=4.5 stop.
        for job, value in zip(jobs, (5.0, 4.0, 6.0, 4.5), strict=True):
            await metric(handle, job, 1, value)
        await eventually(lambda: asyncio.sleep(0, sorted(scheduler.cancelled) == ["job-2", "job-3"]))
        # job-0 is preempted: it waits, resumes (from its checkpoint), reports again.
        await event(handle, "job-0", "PENDING", reason="preempted by a higher-priority job")
        await eventually(lambda: _is(state_of(handle, 0), "preempted"))
        await event(handle, "job-0", "RUNNING")
        await metric(handle, "job-0", 3, 3.0)
        # Forged (unknown job) and late (stopped trial) metrics change nothing.
        await metric(handle, "job-forged", 3, 0.0)
        await metric(handle, "job-2", 3, 0.1)
        await metric(handle, "job-1", 3, 3.5)  # second at rung 3, keep 1: stopped
        await eventually(lambda: asyncio.sleep(0, "job-1" in scheduler.cancelled))
        for job in ("job-1", "job-2", "job-3"):
            await event(handle, job, "CANCELLED")  # the stopped jobs' ends arrive late
        await metric(handle, "job-0", 9, 2.0)
        await event(handle, "job-0", "SUCCEEDED")
        result = await handle.result()
    states = {t.index: t.state for t in result.trials}
    assert states == {0: "completed", 1: "stopped", 2: "stopped", 3: "stopped"}
    assert result.best_trial == 0 and result.best_metric == 2.0
    assert result.trials[0].preemptions == 1 and result.trials[0].final == 2.0
    assert [t.stopped_at for t in result.trials] == [None, 3, 1, 1]
    assert result.ignored_metrics == 2
    assert result.summary["ignored_recent"] == ["unknown job job-forged", "trial 2 is stopped"]
    assert sorted(scheduler.cancelled) == ["job-1", "job-2", "job-3"]
    study = optuna.load_study(study_name=sweep_id, storage=f"sqlite:///{tmp_path / 'optuna.db'}")
    assert sorted(t.state.name for t in study.trials) == ["COMPLETE", "PRUNED", "PRUNED", "PRUNED"]
    assert study.best_trial.params == {"optim.lr": 0.001}
    assert tracker.runs["job-1"] == {
        "tags": {"forge.sweep_id": sweep_id, "forge.trial": "1"},
        "parent": "parent",
    }
    assert tracker.ended == {
        "run-job-0": "FINISHED",
        "run-job-1": "KILLED",
        "run-job-2": "KILLED",
        "run-job-3": "KILLED",
        "parent": "FINISHED",  # the sweep's own run is closed too, with its summary
    }
    parent = tracker.metrics["parent"]
    assert {
        k: parent[k] for k in ("best_metric", "best_trial", "gpu_hours", "trials_completed", "trials_stopped")
    } == {
        "best_metric": result.best_metric,
        "best_trial": 0.0,
        "gpu_hours": result.gpu_hours,
        "trials_completed": 1.0,
        "trials_stopped": 3.0,
    }
    # and how far the rungs could be trusted (one trial finished: no rank correlation to log)
    assert parent["stopped"] == 3.0 and 0 <= parent["stopped_within_noise"] <= 3
    assert not any(k.startswith("rung_") for k in parent)


async def _is(state: Awaitable[str], wanted: str) -> bool:
    return await state == wanted


async def test_sweep_survives_worker_restart_failures_and_silent_trials(
    client: Client, tmp_path: Path
) -> None:
    """Worker A submits the trials and is shut down; events arrive while no worker runs; worker B
    (new activities, same database) finishes the sweep. No trial is submitted twice; a crashing
    configuration is failed once; a trial that never reports is timed out."""
    space = SPACE.replace("concurrency: 4", "concurrency: 2").replace(
        "early_stopping: {rule: asha, min_steps: 1, eta: 3, form: stopping}",
        "early_stopping: {rule: none}\nmetrics_timeout_s: 2",
    )
    queue = f"sweep-{uuid.uuid4().hex[:8]}"
    storage = f"sqlite+aiosqlite:///{tmp_path / 'orchestrator.db'}"
    first = FakeScheduler()
    async with worker_for(client, queue, first, SweepActivities(storage)):
        handle = await client.start_workflow(
            "sweep", SweepInput(space=space, team="research"), id=f"sweep-{uuid.uuid4().hex[:8]}", task_queue=queue,
            result_type=SweepResult,
        )  # fmt: skip
        await eventually(lambda: asyncio.sleep(0, len(first.submitted) == 2))
    # No worker: job-0 crashes, job-1 finishes.
    await event(handle, "job-0", "RUNNING")
    await event(handle, "job-0", "FAILED", reason="exit 1: ZeroDivisionError")
    await event(handle, "job-1", "RUNNING")
    await metric(handle, "job-1", 9, 1.5)
    await event(handle, "job-1", "SUCCEEDED")
    second = FakeScheduler()
    async with worker_for(client, queue, second, SweepActivities(storage)):
        await eventually(lambda: asyncio.sleep(0, len(second.submitted) == 2))
        # job-2 runs and reports nothing: timed out after metrics_timeout_s; job-3 completes.
        await event(handle, "job-2", "RUNNING")
        await event(handle, "job-3", "RUNNING")
        await metric(handle, "job-3", 9, 1.2)
        await event(handle, "job-3", "SUCCEEDED")
        result = await handle.result()
    assert sorted(first.submitted) == ["job-0", "job-1"] and sorted(second.submitted) == ["job-2", "job-3"]
    assert {t.index: t.state for t in result.trials} == {
        0: "failed",
        1: "completed",
        2: "timed_out",
        3: "completed",
    }
    assert "ZeroDivisionError" in result.trials[0].reason and "no val_loss" in result.trials[2].reason
    assert second.cancelled == ["job-2"]
    assert result.best_trial == 3
    history = await handle.fetch_history()
    submits = [
        e
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and e.activity_task_scheduled_event_attributes.activity_type.name == "submit_job"
    ]
    assert len(submits) == 4
    # The recorded history replays deterministically against the workflow code.
    replayed = await Replayer(workflows=[SweepWorkflow]).replay_workflow(history)
    assert replayed.replay_failure is None


def test_bad_sweeps_are_refused_naming_the_field() -> None:
    cases = {
        "input.space.parameters.optim.lrr": SPACE.replace("optim.lr:", "optim.lrr:"),
        "input.space.metric.name": SPACE.replace("name: val_loss", "name: bleu"),
        "input.space.budget.trials": SPACE.replace("trials: 4", "trials: 0"),
        "input.space.parameters.optim.lr.values": SPACE.replace("[0.001, 0.002, 0.003, 0.004]", "[]"),
    }
    for field, text in cases.items():
        with pytest.raises(errors.ValidationError) as caught:
            validate_sweep(SweepInput(space=text, team="research"))
        assert caught.value.field == field, caught.value
    with pytest.raises(errors.ValidationError, match=r"input\.space\.team"):
        validate_sweep(SweepInput(space=SPACE, team="other"))


def test_a_sweep_started_before_the_budgeted_default_keeps_the_guarded_rule() -> None:
    default = sweepspace.parse(SPACE.replace("{rule: asha, min_steps: 1, eta: 3, form: stopping}", "{}"))
    assert type(rule_of(default)) is Budgeted and type(rule_of(default, budgeted=False)) is Guarded
    asha = sweepspace.parse(SPACE)
    assert type(rule_of(asha)) is type(rule_of(asha, budgeted=False)) is Asha  # only the default changed


async def test_lost_nodes_past_the_limit_fail_a_trial_and_spent_gpu_hours_cancel_the_rest(
    client: Client, tmp_path: Path
) -> None:
    """Two lost nodes with max_infra_retries=1 fail trial 0 (its job cancelled); a GPU-hour budget
    of 2 s of one device runs out while trial 1 runs: it is cancelled and nothing new starts."""
    space = (
        SPACE.replace("gpu_hours: 10", "gpu_hours: 0.0006")
        .replace(
            "early_stopping: {rule: asha, min_steps: 1, eta: 3, form: stopping}",
            "early_stopping: {rule: none}",
        )
        .replace("concurrency: 4", "concurrency: 2")
    )
    queue = f"sweep-{uuid.uuid4().hex[:8]}"
    scheduler, tracker = FakeScheduler(), RecordingTracker()
    storage = f"sqlite+aiosqlite:///{tmp_path / 'orchestrator.db'}"
    async with worker_for(client, queue, scheduler, SweepActivities(storage, tracker)):
        handle = await client.start_workflow(
            "sweep", SweepInput(space=space, team="research", max_infra_retries=1), id=f"sweep-{uuid.uuid4().hex[:8]}",
            task_queue=queue, result_type=SweepResult,
        )  # fmt: skip
        await eventually(lambda: asyncio.sleep(0, len(scheduler.submitted) == 2))
        for _ in range(2):
            await event(handle, "job-0", "RUNNING")
            await event(handle, "job-0", "PENDING", reason="node n1 lost")
        await eventually(lambda: asyncio.sleep(0, "job-0" in scheduler.cancelled))
        await event(handle, "job-1", "RUNNING")
        result = await handle.result()
    assert result.trials[0].state == "failed" and result.trials[0].infra_retries == 2
    assert "lost its node 2 times" in result.trials[0].reason
    assert result.budget_exhausted == "gpu_hours"
    assert result.trials[1].state == "cancelled" and "GPU-hour budget" in result.trials[1].reason
    assert result.gpu_hours >= 0.0006
    # Trial 2 may have started when trial 0 failed (before the budget ran out); none after.
    assert len(scheduler.submitted) <= 3 and all(t.state != "completed" for t in result.trials)


async def test_cancelling_the_sweep_cancels_its_running_trials(client: Client, tmp_path: Path) -> None:
    queue = f"sweep-{uuid.uuid4().hex[:8]}"
    scheduler, tracker = FakeScheduler(), RecordingTracker()
    storage = f"sqlite+aiosqlite:///{tmp_path / 'orchestrator.db'}"
    async with worker_for(client, queue, scheduler, SweepActivities(storage, tracker)):
        handle = await client.start_workflow(
            "sweep",
            SweepInput(space=SPACE, team="research"),
            id=f"sweep-{uuid.uuid4().hex[:8]}",
            task_queue=queue,
        )
        await eventually(lambda: asyncio.sleep(0, len(scheduler.submitted) == 4))
        await event(handle, "job-0", "RUNNING")
        await metric(handle, "job-0", 9, 1.0)
        await event(handle, "job-0", "SUCCEEDED")
        await eventually(lambda: _is(state_of(handle, 0), "completed"))
        await handle.cancel()
        with pytest.raises(WorkflowFailureError):
            await handle.result()
    assert sorted(scheduler.cancelled) == ["job-1", "job-2", "job-3"]  # not the finished one
    assert tracker.ended["parent"] == "KILLED"  # the sweep's run is closed when it is cancelled
    assert tracker.metrics["parent"]["trials_completed"] == 1.0


class RefusingScheduler(FakeScheduler):
    """Refuses the third submission for good (as the scheduler does a spec it cannot run)."""

    @activity.defn(name="submit_job")
    async def submit_job(self, params: SubmitJobInput) -> str:
        if params.request_id.endswith("trial-2"):
            raise ApplicationError("SubmitJob: INVALID_ARGUMENT: no such gpu_type", non_retryable=True)
        return await super().submit_job(params)


async def test_a_refused_submission_fails_the_sweep_and_cancels_its_jobs(
    client: Client, tmp_path: Path
) -> None:
    queue = f"sweep-{uuid.uuid4().hex[:8]}"
    scheduler, tracker = RefusingScheduler(), RecordingTracker()
    storage = f"sqlite+aiosqlite:///{tmp_path / 'orchestrator.db'}"
    async with worker_for(client, queue, scheduler, SweepActivities(storage, tracker)):
        handle = await client.start_workflow(
            "sweep",
            SweepInput(space=SPACE, team="research"),
            id=f"sweep-{uuid.uuid4().hex[:8]}",
            task_queue=queue,
        )
        with pytest.raises(WorkflowFailureError):
            await handle.result()
    assert sorted(scheduler.submitted) == ["job-0", "job-1"]
    assert sorted(scheduler.cancelled) == ["job-0", "job-1"]
    assert tracker.ended["parent"] == "FAILED"  # and when it fails


class ResumingScheduler(FakeScheduler):
    """Job ids ``job-<trial>`` for a trial's first job, ``job-<trial>-<n>`` for its later ones."""

    @activity.defn(name="submit_job")
    async def submit_job(self, params: SubmitJobInput) -> str:
        job_id = "job-" + params.request_id.rsplit("/trial-", 1)[-1]
        self.submitted[job_id] = params
        return job_id


async def test_asha_promotion_form_pauses_at_rungs_and_resumes_promoted_trials_from_their_checkpoints(
    client: Client, tmp_path: Path
) -> None:
    """η = 3, rungs 1 and 3 (full budget 9), two slots, four configurations:

    rung 1: t0=5.0 (n=1, top 0: pause; t2 starts), t1=4.0 (n=2: pause; t3 starts), t2=6.0 (n=3,
    top 1 = {t1}: t2 pauses, t1 is resumed as job-1-1), t3=3.0 (n=4, top 1 = {t3}: goes on);
    rung 3: t1=3.5 (n=1: pause; nothing promotable while t3 may still come), t3=2.5 (n=2: pause;
    nothing can reach rung 3 any more, so its best, t3, is resumed as job-3-1 and finishes).
    """
    space = SPACE.replace("concurrency: 4", "concurrency: 2").replace(", form: stopping", "")
    queue = f"sweep-{uuid.uuid4().hex[:8]}"
    scheduler, tracker = ResumingScheduler(), RecordingTracker()
    sweeps = SweepActivities(f"sqlite+aiosqlite:///{tmp_path / 'orchestrator.db'}", tracker)
    submitted = lambda *jobs: asyncio.sleep(0, all(j in scheduler.submitted for j in jobs))  # noqa: E731
    async with worker_for(client, queue, scheduler, sweeps):
        handle = await client.start_workflow(
            "sweep",
            SweepInput(space=space, team="research"),
            id=f"sweep-{uuid.uuid4().hex[:8]}",
            task_queue=queue,
            result_type=SweepResult,
        )
        await eventually(lambda: submitted("job-0", "job-1"))
        for job, value, starts in (
            ("job-0", 5.0, "job-2"),
            ("job-1", 4.0, "job-3"),
            ("job-2", 6.0, "job-1-1"),
        ):
            await event(handle, job, "RUNNING")
            await metric(handle, job, 1, value)
            await eventually(lambda starts=starts: submitted(starts))  # type: ignore[misc]
        await event(handle, "job-3", "RUNNING")
        await metric(handle, "job-3", 1, 3.0)
        resumed = scheduler.submitted["job-1-1"]
        assert resumed.command[-2:] == ["--resume-from", "job-1"] and resumed.labels["resumes_job"] == "job-1"
        await metric(handle, "job-1", 2, 0.1)  # a late value of the trial's paused job: ignored
        await event(handle, "job-1", "CANCELLED")  # the paused job's end: changes nothing
        await event(handle, "job-1-1", "RUNNING")
        await metric(handle, "job-1-1", 3, 3.5)
        await eventually(lambda: _is(state_of(handle, 1), "paused"))
        assert (await progress(handle))["trials_by_state"] == {"paused": 3, "running": 1}
        await metric(handle, "job-3", 3, 2.5)
        await eventually(lambda: submitted("job-3-1"))
        await event(handle, "job-3-1", "RUNNING")
        await metric(handle, "job-3-1", 9, 2.0)
        await event(handle, "job-3-1", "SUCCEEDED")
        result = await handle.result()
    assert {t.index: t.state for t in result.trials} == {
        0: "stopped",
        1: "stopped",
        2: "stopped",
        3: "completed",
    }
    assert [t.stopped_at for t in result.trials] == [1, 3, 1, None]
    assert result.best_trial == 3 and result.best_metric == 2.0
    assert sorted(scheduler.submitted) == ["job-0", "job-1", "job-1-1", "job-2", "job-3", "job-3-1"]
    assert sorted(scheduler.cancelled) == ["job-0", "job-1", "job-1-1", "job-2", "job-3"]
    assert result.ignored_metrics == 1 and result.summary["rung_occupancy"] == {"1": 4, "3": 2}
    assert sorted(tracker.runs) == ["job-0", "job-1", "job-2", "job-3", "parent"]  # one run per trial
    assert tracker.ended["run-job-3"] == "FINISHED" and tracker.ended["run-job-1"] == "KILLED"


async def test_cooldown_rungs_are_judged_on_the_branch_values_only(client: Client, tmp_path: Path) -> None:
    """``rung_eval: cooldown`` (stopping form, rungs 1 and 3): every trial's job runs with the
    branch keys; at rung 1 job-1's own value (1.0) would make it the best, but its value after the
    branch (4.0) is what ASHA compares, and it stops behind job-0 (3.0)."""
    space = SPACE.replace("form: stopping}", "form: stopping, rung_eval: cooldown, cooldown_fraction: 0.5}")
    space = space.replace("concurrency: 4", "concurrency: 2")
    queue = f"sweep-{uuid.uuid4().hex[:8]}"
    scheduler = FakeScheduler()
    sweeps = SweepActivities(f"sqlite+aiosqlite:///{tmp_path / 'orchestrator.db'}", RecordingTracker())
    async with worker_for(client, queue, scheduler, sweeps):
        handle = await client.start_workflow(
            "sweep",
            SweepInput(space=space, team="research"),
            id=f"sweep-{uuid.uuid4().hex[:8]}",
            task_queue=queue,
            result_type=SweepResult,
        )
        await eventually(lambda: asyncio.sleep(0, len(scheduler.submitted) == 2))
        command = scheduler.submitted["job-0"].command
        assert "rung_cooldown.fraction=0.5" in command and "rung_cooldown.min_steps=1" in command
        for job in ("job-0", "job-1"):
            await event(handle, job, "RUNNING")
        await metric(handle, "job-0", 1, 5.0)
        await cooled(handle, "job-0", 1, 3.0)
        await metric(handle, "job-1", 1, 1.0)  # the run's own value: no decision
        await eventually(lambda: _is(state_of(handle, 1), "running"))
        assert scheduler.cancelled == []
        await cooled(handle, "job-1", 1, 4.0)
        await eventually(lambda: asyncio.sleep(0, scheduler.cancelled == ["job-1"]))
        trials = (await progress(handle))["trials"]
        assert trials[1]["state"] == "stopped" and trials[1]["values"] == [[1.0, 1.0]]
        assert trials[1]["rung_values"] == [[1.0, 4.0]] and trials[0]["rung_values"] == [[1.0, 3.0]]
        await handle.cancel()
        with pytest.raises(WorkflowFailureError):
            await handle.result()


async def cooled(handle: WorkflowHandle[Any, Any], job: str, step: int, value: float) -> None:
    await handle.signal(
        METRIC_SIGNAL, TrialMetric(job, step, value, event_id=uuid.uuid4().hex, cooldown=True)
    )


#: (setting, curves at steps 1-3, finals of the resumed trials, trials by state once they are
#: resumed, end states, trust: stopped within the noise, rung 3's correlations)
RUNG_CASES = {
    # t1 (rate 0.002, 3.0) is the top third at rung 3, t0 (the lowest rate, 3.6) on the rate front,
    # t2 (0.003, 4.5) beaten by lower rates: t1 and t0 resumed; t0, behind at rung 3, finishes
    # first, so rung 3 ranked the finishers in reverse
    "guarded": (
        "{rule: guarded}",
        {"job-0": [5.5, 4.6, 3.6], "job-1": [5.0, 4.0, 3.0], "job-2": [6.0, 5.0, 4.5]},
        {"job-0-1": 2.4, "job-1-1": 2.5},
        {"paused": 1, "pending": 2},
        ["completed", "completed", "stopped"],
        (0, {"finished": 2, "spearman": -1.0, "kendall": -1.0}),
    ),
    # the default (budgeted): half the grid's 27 steps less the 12 spent leaves one finisher, the
    # best projected to step 9 (2 · v3 - v1): t0 0.4, t1 1.0, t2 3.0; t1, the rung's leader, stops
    # with a value no worse than the best there: a stop within the (zero) noise
    "default": (
        "{}",
        {"job-0": [6.0, 4.6, 3.2], "job-1": [5.0, 4.0, 3.0], "job-2": [6.0, 5.0, 4.5]},
        {"job-0-1": 2.4},
        {"paused": 2, "pending": 1},
        ["completed", "stopped", "stopped"],
        (1, {"finished": 1, "spearman": None, "kendall": None}),
    ),
}


@pytest.mark.parametrize("case", sorted(RUNG_CASES))
async def test_complete_rungs_decide_once_and_the_sweep_reports_its_trust(
    client: Client, tmp_path: Path, case: str
) -> None:
    """Rungs 1 and 3 of 9 (a 27th and a 9th of the budget, at least 1) with no ``min_steps``.
    Every trial goes on past rung 1 (no ranking to compare with yet). At rung 3 every trial waits
    until the rung is complete (no trial can still reach it); then the rule decides once (see
    :data:`RUNG_CASES`). The parent run gets the sweep's figures."""
    setting, curves, finals, waiting, states, (within, rung3) = RUNG_CASES[case]
    space = SPACE.replace(
        "early_stopping: {rule: asha, min_steps: 1, eta: 3, form: stopping}", f"early_stopping: {setting}"
    )
    space = space.replace("0.001, 0.002, 0.003, 0.004", "0.001, 0.002, 0.003").replace(
        "trials: 4", "trials: 3"
    )
    queue = f"sweep-{uuid.uuid4().hex[:8]}"
    scheduler, tracker = ResumingScheduler(), RecordingTracker()
    sweeps = SweepActivities(f"sqlite+aiosqlite:///{tmp_path / 'orchestrator.db'}", tracker)
    submitted = lambda *jobs: asyncio.sleep(0, all(j in scheduler.submitted for j in jobs))  # noqa: E731
    async with worker_for(client, queue, scheduler, sweeps):
        handle = await client.start_workflow(
            "sweep",
            SweepInput(space=space, team="research"),
            id=f"sweep-{uuid.uuid4().hex[:8]}",
            task_queue=queue,
            result_type=SweepResult,
        )
        await eventually(lambda: submitted("job-0", "job-1", "job-2"))
        for job in curves:
            await event(handle, job, "RUNNING")
        for step in (1, 2, 3):
            for job, values in curves.items():
                await metric(handle, job, step, values[step - 1])
            if step == 1:
                await eventually(lambda: _is(state_of(handle, 2), "running"))
                assert scheduler.cancelled == []  # nothing waits at the first rung
        await eventually(lambda: submitted(*finals))
        assert (await progress(handle))["trials_by_state"] == waiting
        for job, final in finals.items():
            await event(handle, job, "RUNNING")
            await metric(handle, job, 9, final)
            await event(handle, job, "SUCCEEDED")
        result = await handle.result()
    stopped = len(states) - len(finals)
    assert [t.state for t in result.trials] == states
    assert [t.stopped_at for t in result.trials] == [None if s == "completed" else 3 for s in states]
    assert result.best_metric == 2.4
    assert result.rungs == [1, 3] and result.summary["rung_occupancy"] == {"1": 3, "3": 3}
    trust = result.summary["trust"]
    assert trust["stopped"] == stopped and trust["stopped_within_noise"] == within
    assert trust["rungs"]["3"] == rung3
    logged = tracker.metrics["parent"]
    assert logged["best_metric"] == 2.4 and logged["stopped"] == stopped
    assert logged["stopped_within_noise"] == within
    assert logged["trials_completed"] == len(finals) and logged["trials_stopped"] == stopped
    assert tracker.ended["parent"] == "FINISHED"
