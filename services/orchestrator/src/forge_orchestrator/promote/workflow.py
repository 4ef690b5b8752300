"""The ``eval_and_promote`` workflow (:class:`EvalAndPromoteWorkflow`, its steps in its docstring)
and :func:`wait_eval_run`, which every workflow that runs eval suites uses. Deterministic: time from
``workflow.now()``, every call to another service through an activity (eval's in
:mod:`~forge_orchestrator.eval_activities`, the canary's in
:mod:`~forge_orchestrator.promote.canary_activities`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from forge_orchestrator.deploy.promotion import Served
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
    from forge_orchestrator.inbox import ACTIVITY_RETRY, PROGRESS_QUERY
    from forge_orchestrator.promote.canary import CanaryOutcome, guard_canary
    from forge_orchestrator.promote.canary_activities import CanaryActivities, PolicyInput
    from forge_orchestrator.promote.model import EvalAndPromoteInput, EvalAndPromoteResult, policy_family

#: Start-to-close timeout of a call to eval (and, in eval-and-promote, of the canary's and the
#: deployments' activities).
EVAL_ACTIVITY_TIMEOUT = timedelta(seconds=60)


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


#: ``workflow.patched`` marker of the promotion's replica steps (histories from before it replay
#: without them).
ROLL_REPLICAS = "eval-and-promote-rolls-replicas"
#: ``workflow.patched`` marker of step 2's release runs on the models' replicas.
RUNS_ON_REPLICAS = "eval-and-promote-runs-on-replicas"


@workflow.defn(name="eval_and_promote")
class EvalAndPromoteWorkflow:
    """Evaluate a candidate and promote it through canary to production unless it regresses.

    1. register the candidate in eval's registry (idempotent), with its lineage and this
       workflow's id as the label ``workflow_id`` (how callers find the workflow of a checkpoint);
    2. look up the production model; run the suite on the candidate and, when production exists,
       on production too, with the same spec (suite, tier, limit, seed). Unless an endpoint is
       given: where promotions roll replicas (:mod:`forge_orchestrator.deploy.rollout`), each
       model's deployment is made ready first (the candidate's, and production's, which normally
       runs already) and the runs score those replicas through eval's default endpoint, the
       gateway, pinned by ``name:version``; replicas not ready in time block the release (a
       deployment this workflow made is undeployed). Elsewhere each run is on a model server eval
       starts for it from the model's checkpoint;
    3. wait for the runs (durable timers between polls); a failed run fails the workflow;
    4. compare with production: WORSE blocks the release and returns the reason and report (and
       undeploys the candidate's deployment if step 2 made it); otherwise
    5. where promotions roll replicas (:mod:`forge_orchestrator.deploy.rollout`), deploy the
       candidate and wait until its replicas are in the gateway's pool (not ready in time: blocked,
       and its deployment undeployed);
    6. promote to ``canary`` through eval's release gate (``ModelPromoted`` tells the gateway) at
       the canary policy's traffic share, and guard it (:mod:`forge_orchestrator.promote.canary`): the
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

    async def _replicas_for_runs(
        self, params: EvalAndPromoteInput, candidate: ModelId, production: ModelId | None
    ) -> tuple[Served | None, str]:
        """Step 2's replicas: (the candidate's deployment, None where promotions roll no replicas;
        why the release is blocked, empty when every model's replicas are ready)."""
        self._step = "deploying for the release runs"
        served = await serve_version(self._call, str(candidate), params.uri, params.poll_s)
        if not served.deployment:
            return None, ""
        if not served.ready:
            return served, (
                f"the candidate's replicas ({served.deployment}) were not ready within "
                f"{served.ready_timeout_s:g}s: {served.message}"
            )
        if production is not None:
            uri: str = await self._call(EvalActivities.model_uri, production)
            theirs = await serve_version(self._call, str(production), uri, params.poll_s)
            if not theirs.ready:
                return served, (
                    f"production's replicas ({theirs.deployment}) were not ready within "
                    f"{theirs.ready_timeout_s:g}s: {theirs.message}"
                )
        return served, ""

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
        made = False
        if serve and workflow.patched(RUNS_ON_REPLICAS):
            served, blocked = await self._replicas_for_runs(params, candidate, production)
            made = served is not None and served.created
            if blocked:
                result = EvalAndPromoteResult(candidate_run_id="", decision="blocked", blocked_reason=blocked)
                if made:
                    result.drained = await drain_version(self._call, str(candidate), params.poll_s)
                self._step = "blocked"
                return result
            # The runs score the replicas through eval's default endpoint, the gateway.
            serve = served is None

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
                if made:
                    result.drained = await drain_version(self._call, str(candidate), params.poll_s)
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
