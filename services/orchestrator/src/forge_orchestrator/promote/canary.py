"""The guarded canary, as workflow code (deterministic: time from ``workflow.now()``, every call
through an activity): the step of ``eval_and_promote`` between canary and production.

1. the model family's policy (``policies/canary/<family>.yaml``) gives the traffic share, the
   analysis window, the interval between looks and the thresholds;
2. the candidate goes to canary at that share (the gateway splits the production aliases, sticky
   per user/session) and the gateway's counters are read as the window's baseline;
3. every ``interval_s`` (a durable timer: an orchestrator restart resumes the wait), the
   registry's state is read — an operator's ``forge eval rollout promote|rollback`` ends the
   analysis with their decision, ``pause`` keeps it from promoting — and the analysis looks at
   the counts since the baseline: ``continue``, ``extend`` (too little traffic; recorded),
   ``rollback`` or ``promote``, each recorded in the registry with its evidence.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError

from forge_orchestrator.eval_activities import DecisionInput, EvalActivities, ModelId, RolloutState
from forge_orchestrator.promote.canary_activities import (
    CanaryActivities,
    Look,
    LookInput,
    Snapshot,
    SnapshotInput,
)


@dataclass
class CanaryOutcome:
    """What the guarded canary decided, and on what."""

    decision: str = ""
    """``promote`` or ``rollback``."""
    reason: str = ""
    decided_by: str = "analysis"
    """``analysis``, or the operator who overrode it."""
    decided_after_s: float = 0.0
    policy: str = ""
    traffic_percent: int = 0
    canary_requests: int = 0
    production_requests: int = 0
    extensions: int = 0
    looks: int = 0
    evidence: str = ""
    progress: dict[str, Any] = field(default_factory=dict)


Call = Callable[..., Awaitable[Any]]


async def guard_canary(
    call: Call, candidate: ModelId, production: ModelId, policy: dict[str, Any], outcome: CanaryOutcome
) -> CanaryOutcome:
    """Steps 2-3 of the module docstring, after ``call`` promoted the candidate to canary;
    ``outcome`` is updated as the analysis goes (the workflow's progress query shows it)."""
    outcome.policy = f"{policy['family']}@{policy['version']}"
    series = SnapshotInput(str(candidate), str(production))
    start: Snapshot = await call(CanaryActivities.canary_snapshot, series)
    started = workflow.now()
    previous: dict[str, list[float]] = {}
    now = start
    while True:
        await workflow.sleep(timedelta(seconds=float(policy["interval_s"])))
        elapsed = (workflow.now() - started).total_seconds()
        state: RolloutState = await call(EvalActivities.rollout_state, candidate)
        if state.stage != "canary":
            outcome.decision = "promote" if state.stage == "production" else "rollback"
            outcome.decided_by = state.actor or "operator"
            outcome.reason = f"operator override: {state.reason}"
            outcome.decided_after_s = round(elapsed, 3)
            return outcome
        try:
            now = await call(CanaryActivities.canary_snapshot, series)
        except ActivityError as exc:
            # The gateway unreadable: this look uses the last counts; the window still runs out.
            outcome.progress["metrics_error"] = str(exc.cause or exc)
        look: Look = await call(
            CanaryActivities.canary_look,
            LookInput(policy, start, now, elapsed, outcome.extensions, previous, state.paused),
        )
        previous = look.p_values
        outcome.looks += 1
        outcome.canary_requests, outcome.production_requests = look.canary_requests, look.production_requests
        outcome.progress.update(
            {
                "last_look": look.decision,
                "reason": look.reason,
                "elapsed_s": round(elapsed, 3),
                "paused": state.paused,
            }
        )
        if look.decision == "continue":
            continue
        await call(
            EvalActivities.decide_rollout, DecisionInput(candidate, look.decision, look.reason, look.evidence)
        )
        if look.decision == "extend":
            outcome.extensions += 1
            continue
        outcome.decision, outcome.reason, outcome.evidence = look.decision, look.reason, look.evidence
        outcome.decided_after_s = round(elapsed, 3)
        return outcome
