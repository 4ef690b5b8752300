"""The ``sweep`` workflow: a hyperparameter search or an ablation, its trials scheduler jobs.

In steps:

1. parse the space (:mod:`forge_experiments.sweepspace`; the API refused a bad one before starting),
   create its Optuna study, and (when tracking is configured) the sweep's parent run;
2. keep up to ``concurrency`` trials running. Each trial is a checkpointable job of the space's
   priority class (preemptible by default) submitted with the caller's rights, running the
   recipe with the trial's overrides, labelled with this workflow's id; its parameters come from
   the grid, or from the study's sampler (random, TPE) through an activity;
3. follow each trial's job events (``job_event``) and its metric (``trial_metric``, sent by the
   orchestrator's ``TrainingMetrics`` consumer with (job, step, value)):
   - the early-stopping rule (:mod:`forge_experiments.earlystop`) judges each value as it arrives
     (under ``rung_eval: cooldown``, each value after a rung's branch); a stopped trial is
     cancelled (its job checkpoints on SIGTERM) and recorded ``stopped``. Under the promotion
     form (the budgeted and guarded rules, ASHA's default) a trial at a rung is ``paused`` unless
     promotable at once; a free slot first resumes the best promotable paused trial (a new job
     from its first job's checkpoints, ``resumes_job``), then starts a new one; still paused at
     the end: ``stopped``;
   - PENDING after it ran: a preemption (the job resumes from its checkpoint when it runs again,
     and the trial is not a failure) or a lost node, an infrastructure failure the scheduler
     retried; past ``max_infra_retries`` the trial is cancelled and recorded ``failed``;
   - FAILED: the configuration's own crash, recorded ``failed`` and never resubmitted;
   - a running trial with no metric for ``metrics_timeout_s``, or any trial past
     ``trial_timeout_s``, is cancelled and recorded ``timed_out``;
   - a metric for a job that is no trial of this sweep, for a finished trial, or from a paused
     trial's earlier job, is counted in ``ignored_metrics`` and otherwise ignored;
4. stop starting trials when the budget (trials, GPU-hours) is spent (running ones are
   cancelled when GPU-hours run out); tell the study each configuration's outcome;
5. return every trial, the best, and the rung occupancy.

The workflow's state is its own (Temporal replays it after a worker restart); every activity is
idempotent (job submission by request id, the study by trial index). Cancelling the workflow
cancels every running trial, and so does its failure (a submission the scheduler refuses).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import math
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ApplicationError, is_cancelled_exception

with workflow.unsafe.imports_passed_through():
    from forge_experiments import sweepspace
    from forge_experiments.earlystop import Asha, AshaPromotion, Guarded, Rule
    from forge_orchestrator.activities import CancelJobInput, SchedulerActivities, SubmitJobInput
    from forge_orchestrator.identity import ADMIN, Caller
    from forge_orchestrator.inbox import (
        ACTIVITY_RETRY,
        ACTIVITY_TIMEOUT,
        JOB_EVENT_SIGNAL,
        PROGRESS_QUERY,
        JobEvent,
    )
    from forge_orchestrator.sweep.activities import (
        TRACK_RETRY,
        TRACK_TIMEOUT,
        StudyInput,
        SuggestInput,
        SweepActivities,
        TellInput,
        TrackEndInput,
        TrackSweepInput,
        TrackTrialInput,
    )
    from forge_orchestrator.sweep.model import (
        ACTIVE,
        BUDGETED_RULE,
        MEMO_METRIC,
        METRIC_SIGNAL,
        RESUMES_LABEL,
        SWEEP_LABEL,
        TRIAL_LABEL,
        SweepInput,
        SweepResult,
        Trial,
        TrialMetric,
        rule_of,
        run_metrics,
        trial_command,
        trust_of,
    )
    from forge_orchestrator.training.model import CHECKPOINT_SIGNAL, CheckpointInfo

__all__ = ["MEMO_METRIC", "METRIC_SIGNAL", "SweepInput", "SweepResult", "SweepWorkflow", "TrialMetric"]
_MAX_IGNORED_KEPT = 20


@workflow.defn(name="sweep")
class SweepWorkflow:
    def __init__(self) -> None:
        self._inbox: list[JobEvent | TrialMetric] = []
        self._seen: set[str] = set()
        self._trials: list[Trial] = []
        self._by_job: dict[str, int] = {}
        self._ran: dict[str, bool] = {}
        self._ignored = 0
        self._ignored_recent: list[str] = []
        self._space: sweepspace.Space | None = None
        self._rule: Rule | None = None
        self._step = "starting"
        self._exhausted = ""
        self._parent_run = ""
        self._told: set[int] = set()
        self._final_wait_s = 60.0
        self._checkpoint_wait = False
        self._checkpoints = 0

    # Signals and query.

    @workflow.signal(name=JOB_EVENT_SIGNAL)
    def job_event(self, event: JobEvent) -> None:
        if event.event_id:
            if event.event_id in self._seen:
                return
            self._seen.add(event.event_id)
        self._inbox.append(event)

    @workflow.signal(name=METRIC_SIGNAL)
    def trial_metric(self, metric: TrialMetric) -> None:
        if metric.event_id:
            if metric.event_id in self._seen:
                return
            self._seen.add(metric.event_id)
        self._inbox.append(metric)

    @workflow.signal(name=CHECKPOINT_SIGNAL)
    def checkpoint_published(self, checkpoint: CheckpointInfo) -> None:
        """A trial job's checkpoint: the trial keeps its newest (state only: old histories replay)."""
        if checkpoint.event_id:
            if checkpoint.event_id in self._seen:
                return
            self._seen.add(checkpoint.event_id)
        index = self._by_job.get(checkpoint.job_id)
        if index is None or not checkpoint.uri:
            return
        trial = self._trials[index]
        if checkpoint.step >= trial.checkpoint_step:
            trial.checkpoint_uri, trial.checkpoint_step = checkpoint.uri, checkpoint.step
            self._checkpoints += 1

    @workflow.query(name=PROGRESS_QUERY)
    def progress(self) -> dict[str, Any]:
        return {"step": self._step, **self._summary()}

    def _summary(self) -> dict[str, Any]:
        space = self._space
        best = self._best()
        by_state = dict(collections.Counter(t.state for t in self._trials))
        occupancy = self._rule.occupancy() if isinstance(self._rule, Asha | AshaPromotion) else {}
        return {
            "name": space.name if space else "",
            "metric": space.metric if space else "",
            "mode": space.mode if space else "",
            "rungs": space.rungs() if space else [],
            "rung_eval": space.early_stopping.rung_eval if space else "",
            "max_steps": space.max_steps if space else 0,
            "trials_by_state": by_state,
            "rung_occupancy": {str(k): v for k, v in occupancy.items()},
            "best_trial": best.index if best else None,
            "best_metric": best.final if best else None,
            "best_params": best.params if best else None,
            "gpu_hours": round(self._gpu_seconds() / 3600.0, 4),
            "gpu_hours_budget": space.gpu_hours if space else 0.0,
            "trial_budget": space.trials if space else 0,
            "baseline": space.baseline if space else {},
            "seeds": list(space.seeds) if space else [],
            "ignored_metrics": self._ignored,
            "ignored_recent": list(self._ignored_recent),
            "budget_exhausted": self._exhausted,
            "parent_run_id": self._parent_run,
            "trust": trust_of(space, self._trials) if space else {},  # how far the rungs hold
            "trials": [t.summary() for t in self._trials],
        }

    # Helpers.

    def _now(self) -> float:
        return workflow.now().timestamp()

    def _gpu_seconds(self) -> float:
        assert self._space is not None
        now = self._now()
        total = 0.0
        for t in self._trials:
            total += t.gpu_seconds
            if t.running_since is not None:
                total += (now - t.running_since) * self._space.gpus_per_trial
        return total

    def _best(self) -> Trial | None:
        done = [t for t in self._trials if t.final is not None and t.state == "completed"]
        if not done or self._space is None:
            return None
        sign = 1.0 if self._space.mode == "min" else -1.0
        return min(done, key=lambda t: sign * (t.final if t.final is not None else math.inf))

    async def _act(self, method: Any, arg: Any) -> Any:
        tracking = method in (
            SweepActivities.track_sweep,
            SweepActivities.track_trial,
            SweepActivities.track_end,
        )
        timeout, retry = (TRACK_TIMEOUT, TRACK_RETRY) if tracking else (ACTIVITY_TIMEOUT, ACTIVITY_RETRY)
        return await workflow.execute_activity_method(
            method, arg, start_to_close_timeout=timeout, retry_policy=retry
        )

    async def _close_run(self, status: str) -> None:
        """Close the parent run with its status and summary (not in histories from before)."""
        if self._parent_run and workflow.patched("sweep-parent-run-closed"):
            metrics = run_metrics(self._summary())
            await self._act(SweepActivities.track_end, TrackEndInput(self._parent_run, status, metrics))

    def _stop_clock(self, trial: Trial) -> None:
        assert self._space is not None
        if trial.running_since is not None:
            trial.gpu_seconds += (self._now() - trial.running_since) * self._space.gpus_per_trial
            trial.running_since = None

    async def _finish(self, trial: Trial, state: str, reason: str = "", *, cancel: bool = False) -> None:
        """Record a trial's end; cancel its job when it may still run."""
        self._stop_clock(trial)
        trial.state, trial.reason = state, reason
        if cancel and trial.job_id:
            await self._act(SchedulerActivities.cancel_job, CancelJobInput(trial.job_id, reason or state))
        if self._rule is not None and state in ("failed", "timed_out", "cancelled"):
            self._rule.forget(str(trial.index))
        if trial.run_id:
            status = {"completed": "FINISHED", "failed": "FAILED", "timed_out": "FAILED"}.get(state, "KILLED")
            await self._act(SweepActivities.track_end, TrackEndInput(trial.run_id, status))
        await self._tell_config(trial.config)

    async def _tell_config(self, config: int) -> None:
        """Tell the study a configuration's outcome once all its seeds ended."""
        trials = [t for t in self._trials if t.config == config]
        assert self._space is not None
        if config in self._told or len(trials) < max(1, len(self._space.seeds)):
            return
        if any(t.state in (*ACTIVE, "paused") for t in trials):
            return
        self._told.add(config)
        finals = [t.final for t in trials if t.state == "completed" and t.final is not None]
        value = sum(finals) / len(finals) if finals else None
        pruned = value is None and any(t.state == "stopped" for t in trials)
        await self._act(SweepActivities.tell, TellInput(workflow.info().workflow_id, config, value, pruned))

    # The run.

    @workflow.run
    async def run(self, params: SweepInput) -> SweepResult:
        info = workflow.info()
        try:
            space = sweepspace.parse(params.space)
        except Exception as exc:  # noqa: BLE001 - the API checked it; an old or forged input
            raise ApplicationError(f"bad space: {exc}", type="BadSpace", non_retryable=True) from None
        self._space = space
        # a sweep started before the budgeted rule was the default replays with the guarded rule
        self._rule = rule_of(space, budgeted=workflow.patched(BUDGETED_RULE))
        self._final_wait_s = max(params.final_metric_wait_s, params.checkpoint_wait_s)
        self._checkpoint_wait = params.checkpoint_wait_s > 0
        caller = params.caller or ADMIN
        team = params.team or space.team or caller.team
        try:
            # 1. Study, team, tracking.
            self._step = "preparing"
            await self._act(SweepActivities.create_study, StudyInput(info.workflow_id, params.space))
            if caller.is_admin:
                await self._act(SchedulerActivities.ensure_team, team)
            self._parent_run = await self._act(
                SweepActivities.track_sweep,
                TrackSweepInput(
                    info.workflow_id, space.name, {"recipe": space.recipe, "metric": space.metric}
                ),
            )
            # 2-4. Trials.
            await self._loop(params, space, team, caller)
        except (asyncio.CancelledError, Exception) as exc:
            # Cancelled (while waiting, or inside an activity: an ActivityError caused by the
            # cancellation), or failed (a submission the scheduler refuses for good): no trial
            # job outlives the sweep.
            cancelled = is_cancelled_exception(exc)
            self._step = "cancelled" if cancelled else "failed"
            for trial in self._trials:
                if trial.state in (*ACTIVE, "paused"):
                    reason = "sweep cancelled" if cancelled else "sweep failed"
                    await self._finish(trial, "cancelled", reason, cancel=bool(trial.job_id))
            await self._close_run("KILLED" if cancelled else "FAILED")
            raise
        self._step = "done"
        await self._close_run("FINISHED")
        best = self._best()
        return SweepResult(
            name=space.name,
            metric=space.metric,
            mode=space.mode,
            rungs=space.rungs(),
            trials=self._trials,
            best_trial=best.index if best else None,
            best_metric=best.final if best else None,
            gpu_hours=round(self._gpu_seconds() / 3600.0, 4),
            ignored_metrics=self._ignored,
            budget_exhausted=self._exhausted,
            parent_run_id=self._parent_run,
            summary={k: v for k, v in self._summary().items() if k != "trials"},
        )

    def _plan_size(self, space: sweepspace.Space) -> int:
        seeds = max(1, len(space.seeds))
        if space.sampler == "grid":
            return len(space.grid()) * seeds
        return (space.trials // seeds) * seeds

    async def _loop(self, params: SweepInput, space: sweepspace.Space, team: str, caller: Caller) -> None:
        grid = space.grid() if space.sampler == "grid" else []
        seeds: list[int | None] = list(space.seeds) or [None]
        total = self._plan_size(space)
        done = 0
        while True:
            checkpoints = self._checkpoints
            # Budget: GPU-hours spent stops everything.
            if not self._exhausted and self._gpu_seconds() >= space.gpu_hours * 3600.0:
                self._exhausted = "gpu_hours"
                for trial in self._trials:
                    if trial.state in (*ACTIVE, "paused"):
                        await self._finish(
                            trial, "cancelled", "GPU-hour budget spent", cancel=trial.state != "paused"
                        )
            # Launch: a promotion out of a pause first (ASHA's promotion form), then a new trial.
            while not self._exhausted and sum(t.state in ACTIVE for t in self._trials) < space.concurrency:
                promoted = self._promotion(total)
                if promoted is not None:
                    await self._submit(promoted, params, space, team, caller)
                    continue
                if len(self._trials) >= total:
                    break
                index = len(self._trials)
                config, seed = divmod(index, len(seeds))[0], seeds[index % len(seeds)]
                if index % len(seeds) == 0:
                    fixed = grid[config] if grid else {}
                    chosen = await self._act(
                        SweepActivities.suggest,
                        SuggestInput(workflow.info().workflow_id, params.space, config, fixed),
                    )
                else:
                    chosen = dict(self._trials[index - 1].params)
                if isinstance(self._rule, Guarded):  # its rate front needs each trial's rate
                    self._rule.describe(str(index), chosen)
                await self._submit(Trial(index, config, chosen, seed), params, space, team, caller)
            if not any(t.state in ACTIVE for t in self._trials):
                for trial in self._trials:  # paused at a rung and never promoted
                    if trial.state == "paused":
                        await self._finish(
                            trial, "stopped", f"asha: not promoted past step {trial.stopped_at}"
                        )
                return
            # Wait for news, or the next deadline.
            self._step = (
                f"running {sum(t.state in ACTIVE for t in self._trials)} of {len(self._trials)} trials"
            )
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(
                    functools.partial(self._news, done, checkpoints),
                    timeout=timedelta(seconds=self._next_deadline(space)),
                )
            while done < len(self._inbox):  # in arrival order; handling may await activities
                item = self._inbox[done]
                done += 1
                if isinstance(item, JobEvent):
                    await self._on_event(item, params)
                else:
                    await self._on_metric(item)
            await self._check_timeouts(space)
            for trial in self._trials:  # a checkpoint that arrived after the final value
                if trial.state == "finishing" and self._ready(trial):
                    await self._complete(trial)

    async def _submit(
        self, trial: Trial, params: SweepInput, space: sweepspace.Space, team: str, caller: Caller
    ) -> None:
        info = workflow.info()
        overrides = space.trial_overrides(trial.params, trial.seed)
        command = trial_command(params.python, space.recipe, overrides)
        resumes = {RESUMES_LABEL: trial.first_job_id} if trial.first_job_id else {}
        if trial.first_job_id:
            # A promoted trial: a new job that starts from its paused job's newest checkpoint (read
            # only: a job writes only under its own id) and continues its first job's MLflow run.
            command += ["--resume-from", trial.job_id]
        job = SubmitJobInput(
            name=f"{space.name}-t{trial.index}"[:128],
            team=team,
            command=command,
            request_id=f"{info.workflow_id}/{info.run_id}/trial-{trial.index}"
            + (f"-{trial.jobs}" if trial.jobs else ""),
            priority_class=space.priority_class,
            labels={
                "workflow_id": info.workflow_id,
                "recipe": space.recipe,
                SWEEP_LABEL: info.workflow_id,
                TRIAL_LABEL: str(trial.index),
                **resumes,
            },
            auto_eval=False,
            gpu_count=space.gpus_per_trial,
            gpu_type=space.gpu_type,
            checkpointable=True,
            kind="training",
            on_behalf_of=caller.on_behalf_of,
        )
        trial.submitted_at = self._now()
        trial.jobs += 1
        trial.state, trial.stopped_at, trial.last_metric_at = "pending", None, None
        if trial.first_job_id:
            trial.job_id = await self._act(SchedulerActivities.submit_job, job)
            self._by_job[trial.job_id] = trial.index
            return
        self._trials.append(trial)
        trial.job_id = trial.first_job_id = await self._act(SchedulerActivities.submit_job, job)
        self._by_job[trial.job_id] = trial.index
        trial.run_id = await self._act(
            SweepActivities.track_trial,
            TrackTrialInput(
                trial.job_id,
                info.workflow_id,
                trial.index,
                self._parent_run,
                {k: str(v) for k, v in overrides.items()},
            ),
        )

    def _promotion(self, total: int) -> Trial | None:
        """The paused trial a free slot resumes (:meth:`AshaPromotion.next_promotion`), final rungs known."""
        if not isinstance(self._rule, AshaPromotion):
            return None
        assert self._space is not None
        final_below = 0  # rungs no trial can still reach (none left to start, none in flight below)
        if len(self._trials) >= total:
            reached = [self._rule.reached(str(t.index)) for t in self._trials if t.state in ACTIVE]
            final_below = min([*reached, self._space.max_steps])
        found = self._rule.next_promotion(final_below)
        return self._trials[int(found[0])] if found is not None else None

    def _next_deadline(self, space: sweepspace.Space) -> float:
        now = self._now()
        waits = [3600.0]
        for t in self._trials:
            if t.state == "finishing":
                waits.append((t.finishing_since or now) + self._final_wait_s - now)
                continue
            if t.state not in ACTIVE:
                continue
            waits.append(t.submitted_at + space.trial_timeout_s - now)
            if t.state == "running":
                since = t.last_metric_at or t.running_since or now
                waits.append(since + space.metrics_timeout_s - now)
        if space.gpus_per_trial and any(t.running_since is not None for t in self._trials):
            running = sum(t.running_since is not None for t in self._trials) * space.gpus_per_trial
            waits.append((space.gpu_hours * 3600.0 - self._gpu_seconds()) / running)
        return max(1.0, min(waits))

    async def _check_timeouts(self, space: sweepspace.Space) -> None:
        now = self._now()
        for t in self._trials:
            if t.state == "finishing":
                if now - (t.finishing_since or now) >= self._final_wait_s:
                    await self._complete(t)
                continue
            if t.state not in ACTIVE:
                continue
            if now - t.submitted_at >= space.trial_timeout_s:
                await self._finish(t, "timed_out", f"not done within {space.trial_timeout_s:g}s", cancel=True)
            elif (
                t.state == "running"
                and now - (t.last_metric_at or t.running_since or now) >= space.metrics_timeout_s
            ):
                await self._finish(
                    t, "timed_out", f"no {space.metric} for {space.metrics_timeout_s:g}s", cancel=True
                )

    def _news(self, handled: int, checkpoints: int = 0) -> bool:
        return len(self._inbox) > handled or (self._checkpoint_wait and self._checkpoints > checkpoints)

    def _ready(self, trial: Trial) -> bool:
        """A finishing trial has its value at the full budget (and its checkpoint, when waited for)."""
        has_checkpoint = not self._checkpoint_wait or bool(trial.checkpoint_uri)
        return self._final_value(trial) is not None and has_checkpoint

    def _ignore(self, what: str) -> None:
        self._ignored += 1
        self._ignored_recent = [*self._ignored_recent, what][-_MAX_IGNORED_KEPT:]

    async def _on_event(self, event: JobEvent, params: SweepInput) -> None:
        index = self._by_job.get(event.job_id)
        if index is None:
            return
        trial = self._trials[index]
        if trial.state not in ACTIVE or event.job_id != trial.job_id:
            return  # a stopped, paused or timed-out trial's CANCELLED, or a late duplicate
        if event.state in ("SCHEDULED", "RUNNING"):
            if trial.running_since is None:
                trial.running_since = self._now()
            trial.state = "running"
            self._ran[trial.job_id] = True
        elif event.state == "PENDING" and self._ran.get(trial.job_id):
            self._ran[trial.job_id] = False
            self._stop_clock(trial)
            trial.last_metric_at = None
            if "lost" in event.reason:
                trial.infra_retries += 1
                if trial.infra_retries > params.max_infra_retries:
                    await self._finish(
                        trial,
                        "failed",
                        f"lost its node {trial.infra_retries} times: {event.reason}",
                        cancel=True,
                    )
                    return
            else:
                trial.preemptions += 1
            trial.state = "preempted"
        elif event.state == "SUCCEEDED":
            # The final value travels on another topic and may come after the job's end.
            self._stop_clock(trial)
            trial.state = "finishing"
            trial.finishing_since = self._now()
            if self._ready(trial):
                await self._complete(trial)
        elif event.state == "FAILED":
            await self._finish(trial, "failed", event.reason or "the job failed")
        elif event.state == "CANCELLED":
            await self._finish(trial, "cancelled", event.reason or "cancelled outside the sweep")

    def _final_value(self, trial: Trial) -> float | None:
        assert self._space is not None
        at_end = [v for s, v in trial.values if s >= self._space.max_steps]
        return at_end[-1] if at_end else None

    async def _complete(self, trial: Trial) -> None:
        """A succeeded trial's end: its value at the full budget, else its last one."""
        assert self._space is not None
        final = self._final_value(trial)
        if final is None and trial.values:
            final = trial.values[-1][1]
        if final is None:
            await self._finish(trial, "failed", f"succeeded without reporting {self._space.metric}")
            return
        trial.final = final
        await self._finish(trial, "completed")

    async def _on_metric(self, metric: TrialMetric) -> None:
        index = self._by_job.get(metric.job_id)
        if index is None:
            self._ignore(f"unknown job {metric.job_id[:64]}")
            return
        trial = self._trials[index]
        if trial.state not in ACTIVE or metric.job_id != trial.job_id:
            self._ignore(f"trial {index} is {trial.state if trial.state not in ACTIVE else 'on a later job'}")
            return
        value = float(metric.value)
        assert self._space is not None
        if metric.step < 0 or metric.step > self._space.max_steps:
            self._ignore(f"trial {index}: step {metric.step} outside the budget")
            return
        trial.last_metric_at = self._now()
        cooled_rungs = self._space.early_stopping.rung_eval == "cooldown"
        if metric.cooldown:
            trial.rung_values.append([float(metric.step), value])
            if not cooled_rungs or trial.state == "finishing":
                return  # a branch the sweep did not ask for judges nothing
        else:
            trial.values.append([float(metric.step), value])
        if trial.state == "finishing":
            if self._ready(trial):
                await self._complete(trial)
            return
        if trial.state == "pending" or trial.state == "preempted":
            trial.state = "running"
            if trial.running_since is None:
                trial.running_since = self._now()
        if self._rule is None or metric.step >= self._space.max_steps or cooled_rungs != metric.cooldown:
            return  # under rung_eval: cooldown, only the branches' values are judged
        decision = self._rule.report(str(index), metric.step, value)
        if decision == "pause":  # its job checkpoints on SIGTERM; a promotion resumes it
            trial.stopped_at = metric.step
            self._stop_clock(trial)
            trial.state = "paused"
            await self._act(SchedulerActivities.cancel_job, CancelJobInput(trial.job_id, "paused at a rung"))
        elif decision == "stop":
            trial.stopped_at = metric.step
            await self._finish(
                trial, "stopped", f"{self._space.early_stopping.rule} at step {metric.step}", cancel=True
            )
