"""Temporal workflows. Deterministic: time from ``workflow.now()``, ids from ``workflow.uuid4()``,
every call to another service through an activity (``activities.py``).

Workflows that wait on scheduler jobs start from :class:`~forge_orchestrator.inbox.JobEventInbox`:
the ``job_event`` signal, applied once per event id, and the ``progress`` query.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from forge_kit import errors
    from forge_orchestrator.activities import SubmitJobInput
    from forge_orchestrator.canary import CanaryOutcome, guard_canary, policy_family
    from forge_orchestrator.canary_activities import CanaryActivities, PolicyInput
    from forge_orchestrator.deploy.rollout import drain_version, serve_version
    from forge_orchestrator.eval_activities import (
        Comparison,
        EvalActivities,
        ModelId,
        PromoteInput,
        RegisterInput,
        RunInput,
        RunState,
    )
    from forge_orchestrator.identity import ADMIN, Caller
    from forge_orchestrator.inbox import ACTIVITY_RETRY as ACTIVITY_RETRY
    from forge_orchestrator.inbox import ACTIVITY_TIMEOUT as ACTIVITY_TIMEOUT
    from forge_orchestrator.inbox import JOB_EVENT_SIGNAL as JOB_EVENT_SIGNAL
    from forge_orchestrator.inbox import PROGRESS_QUERY as PROGRESS_QUERY
    from forge_orchestrator.inbox import JobEvent as JobEvent
    from forge_orchestrator.inbox import JobEventInbox


@dataclass
class SmokeInput:
    """Input of the platform smoke workflow."""

    team: str = "smoke"
    """Team the smoke job is submitted under; created when missing."""
    timeout_s: float = 60.0
    """How long to wait for each expected job event before failing."""
    hold_s: float = 0.0
    """How long to keep the job queued (a durable timer) between its PENDING event and cancelling it."""
    caller: Caller | None = None
    """Who started the workflow (set by the orchestrator from the caller's token); None: an admin."""


@dataclass
class SmokeResult:
    """Output of the platform smoke workflow."""

    job_id: str
    states_seen: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0


@workflow.defn(name="smoke")
class SmokeWorkflow(JobEventInbox):
    """The platform's smoke job: a job goes through the scheduler and its events come back.

    1. ensure the team and submit a no-op job labelled with this workflow's id;
    2. wait for its PENDING event (scheduler → Kafka → this service's consumer → signal);
    3. optionally hold it for ``hold_s``, then cancel it and wait for its end: CANCELLED, or
       SUCCEEDED when an agent already ran it (the job is ``true``);
    4. return the job id, the states seen in order and the elapsed workflow time.

    Cancelling the workflow cancels the job it submitted.
    """

    async def _wait_for(self, state: str, timeout_s: float, *alternatives: str) -> None:
        wanted = {state, *alternatives}
        self._step = f"waiting for {' or '.join(sorted(wanted))}"
        try:
            await workflow.wait_condition(
                lambda: bool(wanted & set(self._states())), timeout=timedelta(seconds=timeout_s)
            )
        except TimeoutError:
            raise ApplicationError(
                f"no {' or '.join(sorted(wanted))} event for job {self._job_id} within {timeout_s:g}s",
                type="JobEventTimeout",
                non_retryable=True,
            ) from None

    @workflow.run
    async def run(self, params: SmokeInput) -> SmokeResult:
        started = workflow.now()
        info = workflow.info()
        try:
            # 1. Team and job.
            caller = params.caller or ADMIN
            job = SubmitJobInput(
                name=f"smoke-{workflow.uuid4().hex[:8]}",
                team=params.team,
                command=["true"],
                request_id=f"{info.workflow_id}/{info.run_id}/smoke",
                labels={"workflow_id": info.workflow_id},
                on_behalf_of=caller.on_behalf_of,
            )
            await self._submit(job, caller)
            # 2. Its PENDING event.
            await self._wait_for("PENDING", params.timeout_s)
            # 3. Hold, cancel, and its CANCELLED event.
            if params.hold_s > 0:
                self._step = "holding"
                await workflow.sleep(timedelta(seconds=params.hold_s))
            self._step = "cancelling"
            await self._cancel_job("smoke workflow finished")
            await self._wait_for("CANCELLED", params.timeout_s, "SUCCEEDED")
        except asyncio.CancelledError:
            if self._job_id:
                self._step = "cancelled"
                await self._cancel_job("workflow cancelled")
            raise
        # 4. Result.
        self._step = "done"
        elapsed = (workflow.now() - started).total_seconds()
        return SmokeResult(job_id=self._job_id, states_seen=self._states(), elapsed_s=round(elapsed, 3))


EVAL_ACTIVITY_TIMEOUT = timedelta(seconds=60)
#: Eval tiers: ``full`` scores the suite (up to ``limit``), ``smoke`` each task's small stratified
#: subset (eval's ``RunSuite`` accepts exactly these).
TIERS = ("full", "smoke")


@dataclass
class EvalAndPromoteInput:
    """A candidate checkpoint to evaluate and, if it holds up against production, promote."""

    model_name: str
    model_version: str
    uri: str
    """Where the checkpoint lives: a local Hugging Face folder (served for the run), or an object
    store URL when ``endpoint`` serves it."""
    suite: str = "tinyshakespeare_ppl"
    limit: int = 50
    """Examples of the suite to score (0: all); both models are scored on the same ones."""
    seed: int = 0
    endpoint: str = ""
    """OpenAI-compatible endpoint serving both models; empty: a model server eval starts for each
    model's checkpoint (``serve_model``), or eval's default endpoint (the gateway) without it."""
    canary_percent: int = 0
    """The canary's share of the production aliases' traffic; 0: the canary policy's."""
    canary_policy: str = ""
    """Policy family (``policies/canary/<family>.yaml``, else ``default.yaml``); empty: the
    orchestrator's ``canary_policy`` setting, else the model's name."""
    poll_s: float = 2.0
    run_timeout_s: float = 3600.0
    tier: str = "full"
    """``full`` or ``smoke``: each task's small stratified subset, for when compute is short."""
    serve_model: bool = True
    """With no ``endpoint``, evaluate each model on a model server started for its run."""
    training_run_id: str = ""
    recipe_hash: str = ""
    data_hash: str = ""
    parent: str = ""
    """Lineage recorded in the registry; ``parent`` is a registered ``name:version``."""

    def __post_init__(self) -> None:
        # Checked on construction, so an unknown tier is refused when the workflow is started
        # (INVALID_ARGUMENT naming ``input.tier``), not minutes later by eval's RunSuite.
        if self.tier not in TIERS:
            raise errors.ValidationError(
                "input.tier", f"must be one of {', '.join(TIERS)}, got {self.tier!r}"
            )
        if self.canary_policy and policy_family(self.canary_policy) != self.canary_policy:
            raise errors.ValidationError(
                "input.canary_policy", "must be 1-64 of a-z, 0-9, '.', '_', '-' (a policy file's name)"
            )


async def wait_eval_run(
    call: Callable[..., Awaitable[Any]], run_id: str, poll_s: float, timeout_s: float, seen: dict[str, str]
) -> RunState:
    """Poll eval run ``run_id`` on durable timers until it ends (its status kept in ``seen``); a
    failed, cancelled or late run fails the workflow. For workflows that run eval suites."""
    deadline = workflow.now() + timedelta(seconds=timeout_s)
    while True:
        state: RunState = await call(EvalActivities.get_run, run_id)
        seen[run_id] = state.status
        if state.finished:
            if state.status != "SUCCEEDED":
                raise ApplicationError(
                    f"eval run {run_id} {state.status}: {state.error}",
                    type="EvalRunFailed",
                    non_retryable=True,
                )
            return state
        if workflow.now() >= deadline:
            raise ApplicationError(
                f"eval run {run_id} not finished within {timeout_s:g}s",
                type="EvalRunTimeout",
                non_retryable=True,
            )
        await workflow.sleep(timedelta(seconds=poll_s))


@dataclass
class EvalAndPromoteResult:
    candidate_run_id: str
    baseline_run_id: str = ""
    baseline: str = ""
    """The production model it was compared with, ``name:version``; empty for the first model."""
    verdict: str = ""
    promoted_to: list[str] = field(default_factory=list)
    blocked_reason: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    intervals: dict[str, list[float]] = field(default_factory=dict)
    """The candidate's 95% interval per metric (wider for the smoke tier)."""
    tier: str = "full"
    report_path: str = ""
    """The comparison report when compared with production, else the candidate run's report."""
    decision: str = ""
    """``promoted``, ``blocked`` (by the eval comparison, or its replicas not ready in time) or
    ``rolled_back`` (by the canary)."""
    canary: dict[str, Any] = field(default_factory=dict)
    """The guarded canary's decision, reason, timing, traffic and evidence (JSON)."""
    deployment: str = ""
    """The deployment serving the candidate (empty: promotions roll no replicas here)."""
    drained: list[str] = field(default_factory=list)
    """Deployments of the losing version that were drained and undeployed."""


#: ``workflow.patched`` marker of the promotion's replica steps (histories from before it replay
#: without them).
ROLL_REPLICAS = "eval-and-promote-rolls-replicas"


@workflow.defn(name="eval_and_promote")
class EvalAndPromoteWorkflow:
    """Evaluate a candidate and promote it through canary to production unless it regresses.

    1. register the candidate in eval's registry (idempotent), with its lineage and this
       workflow's id as the label ``workflow_id`` (how callers find the workflow of a checkpoint);
    2. look up the production model; run the suite on the candidate and, when production exists,
       on production too, with the same spec (suite, tier, limit, seed) — each on a model server
       eval starts for the run from the model's checkpoint, unless an endpoint is given;
    3. wait for the runs (durable timers between polls); a failed run fails the workflow;
    4. compare with production: WORSE blocks the release and returns the reason and report;
       otherwise
    5. where promotions roll replicas (:mod:`forge_orchestrator.deploy.rollout`), deploy the
       candidate and wait until its replicas are in the gateway's pool (not ready in time: blocked,
       and its deployment undeployed);
    6. promote to ``canary`` through eval's release gate (``ModelPromoted`` tells the gateway) at
       the canary policy's traffic share, and guard it (:mod:`forge_orchestrator.canary`): the
       analysis of live traffic against production promotes it to ``production`` or rolls it
       back. The first model (no production to compare with) goes straight on to production;
    7. the loser (the rolled-back candidate, or the production model it replaced) is drained
       once the gateway no longer routes to it, and its deployment undeployed.
    """

    def __init__(self) -> None:
        self._step = "starting"
        self._runs: dict[str, str] = {}
        self._canary = CanaryOutcome()

    @workflow.query(name=PROGRESS_QUERY)
    def progress(self) -> dict[str, object]:
        return {"step": self._step, "runs": dict(self._runs), "canary": dict(self._canary.progress)}

    async def _call(self, method: Callable[..., Awaitable[Any]], *args: object) -> Any:
        return await workflow.execute_activity_method(
            method,
            args=list(args),
            start_to_close_timeout=EVAL_ACTIVITY_TIMEOUT,
            retry_policy=ACTIVITY_RETRY,
        )

    async def _wait_run(self, run_id: str, params: EvalAndPromoteInput) -> RunState:
        return await wait_eval_run(self._call, run_id, params.poll_s, params.run_timeout_s, self._runs)

    @workflow.run
    async def run(self, params: EvalAndPromoteInput) -> EvalAndPromoteResult:
        candidate = ModelId(params.model_name, params.model_version)
        # 1. Register.
        self._step = "registering"
        await self._call(
            EvalActivities.register_model,
            RegisterInput(
                model=candidate,
                uri=params.uri,
                labels={"workflow_id": workflow.info().workflow_id},
                training_run_id=params.training_run_id,
                recipe_hash=params.recipe_hash,
                data_hash=params.data_hash,
                parent=params.parent,
            ),
        )
        # 2. Production, and the runs.
        self._step = "evaluating"
        production: ModelId | None = await self._call(EvalActivities.current_model, "production")
        if production == candidate:
            production = None
        serve = params.serve_model and not params.endpoint

        def run_input(model: ModelId) -> RunInput:
            return RunInput(
                model=model,
                suite=params.suite,
                limit=params.limit,
                seed=params.seed,
                endpoint=params.endpoint,
                tier=params.tier,
                serve_model=serve,
            )

        candidate_run = await self._call(EvalActivities.run_suite, run_input(candidate))
        baseline_run = ""
        if production is not None:
            baseline_run = await self._call(EvalActivities.run_suite, run_input(production))
        # 3. Wait.
        state = await self._wait_run(candidate_run, params)
        result = EvalAndPromoteResult(
            candidate_run_id=candidate_run,
            metrics=state.metrics,
            intervals=state.intervals,
            tier=state.tier,
            report_path=state.report_path,
        )
        # 4. Compare.
        if production is not None:
            await self._wait_run(baseline_run, params)
            self._step = "comparing"
            comparison: Comparison = await self._call(
                EvalActivities.compare_runs, baseline_run, candidate_run
            )
            result.baseline_run_id = baseline_run
            result.baseline = str(production)
            result.verdict = comparison.verdict
            result.report_path = comparison.report_path or result.report_path
            if comparison.verdict == "WORSE":
                worst = sorted(comparison.deltas.items(), key=lambda kv: kv[1])
                detail = ", ".join(
                    f"{name} {delta:+.3f} (p={comparison.p_values.get(name, 1.0):.3g})"
                    for name, delta in worst
                )
                result.blocked_reason = f"regression against production {result.baseline}: {detail}"
                result.decision = "blocked"
                self._step = "blocked"
                return result
        # 5. Replicas of the candidate, ready before any traffic is split to it.
        rolling = False
        if workflow.patched(ROLL_REPLICAS):
            self._step = "deploying the candidate"
            served = await serve_version(self._call, str(candidate), params.uri, params.poll_s)
            result.deployment, rolling = served.deployment, bool(served.deployment)
            if rolling and not served.ready:
                result.blocked_reason = (
                    f"the candidate's replicas ({served.deployment}) were not ready within "
                    f"{served.ready_timeout_s:g}s: {served.message}"
                )
                result.decision = "blocked"
                result.drained = await drain_version(self._call, str(candidate), params.poll_s)
                self._step = "blocked"
                return result
        # 6. Canary, guarded; then production.
        reason = f"eval run {candidate_run}" + (
            f" vs {result.baseline}: {result.verdict}" if production else ""
        )
        policy: dict[str, Any] = await self._call(
            CanaryActivities.canary_policy,
            PolicyInput(params.canary_policy, policy_family(params.model_name)),
        )
        share = params.canary_percent or int(policy["traffic_percent"])
        self._step = "promoting to canary"
        await self._call(
            EvalActivities.promote_model,
            PromoteInput(model=candidate, stage="canary", traffic_percent=share, reason=reason),
        )
        result.promoted_to.append("canary")
        if production is None:
            self._step = "promoting to production"
            await self._call(
                EvalActivities.promote_model,
                PromoteInput(
                    model=candidate, stage="production", traffic_percent=100, reason=f"{reason}; first model"
                ),
            )
            result.promoted_to.append("production")
            result.decision = "promoted"
            self._step = "done"
            return result
        self._step = "canary analysis"
        self._canary.traffic_percent = share
        outcome = await guard_canary(self._call, candidate, production, policy, self._canary)
        result.canary = {k: v for k, v in vars(outcome).items() if k != "progress"}
        if outcome.decision == "promote":
            result.promoted_to.append("production")
            result.decision = "promoted"
        else:
            result.decision = "rolled_back"
            result.blocked_reason = f"canary rolled back ({outcome.decided_by}): {outcome.reason}"
        # 7. The loser's replicas drained.
        if rolling:
            self._step = "draining the replaced version"
            loser = production if outcome.decision == "promote" else candidate
            result.drained = await drain_version(self._call, str(loser), params.poll_s)
        self._step = f"done: canary {outcome.decision}"
        return result
