"""Every promotion rolls replicas: the ``promotion_rollout`` workflow, one per ``ModelPromoted``.

Eval's registry publishes ``ModelPromoted`` for every change of ``canary`` or ``production``,
whoever made it: ``eval_and_promote``, an operator's ``forge eval promote`` or ``forge eval
rollback``, a canary decision (``forge eval rollout``, or the guarded canary's analysis). The
orchestrator's event consumer (:class:`~forge_orchestrator.event_handlers.PromotionHandler`) starts this
workflow for each, with an id derived from the event, so a redelivered event does nothing twice.

Why here, and not in the promote API: eval owns the registry and cannot call back into the
orchestrator (the orchestrator calls eval: a call back would make a cycle), and the event is the
one place every promotion shows up, made through any client. The replicas themselves are still
started and drained only by ``deployment`` workflows, through the activities and workflow code
``eval_and_promote`` uses (:mod:`forge_orchestrator.deploy.rollout`): one driver per deployment,
one code path.

The registry, not the event, says what to do, so an old event replayed, or one that a later
promotion overtook, starts nothing it should not:

1. the event's model, when it holds the event's stage now: its deployment exists (the running one
   serving ``name:version``, else a new one from the orchestrator's ``promote_deploy_*``
   settings) and every replica is in the gateway's pool, or the wait timed out (``ready`` False).
   ``eval_and_promote`` deployed its candidate before promoting it, so this finds it ready;
2. each version that may have lost (the event's ``previous``; the event's model itself when it
   no longer holds the stage, as after a canary rolled back) is drained unless it still holds a
   serving stage or a gateway alias still routes to it (:func:`~.rollout.drain_loser`).

Where promotions roll no replicas (``promote_deploy`` off), the consumer starts nothing.

Known gap: for a promotion made outside ``eval_and_promote`` the gateway routes to the new
version as the event arrives, before this workflow has its replicas ready; until they are, the
gateway's requests for it find no replica (a version that still has replicas, as a production
rollback to the version the last promotion replaced usually does, serves at once).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from forge_kit import errors
    from forge_kit.modelref import ModelRef
    from forge_orchestrator.deploy.rollout import SERVING_STAGES, drain_loser, serve_version
    from forge_orchestrator.eval_activities import EvalActivities, ModelId, RolloutState
    from forge_orchestrator.inbox import ACTIVITY_RETRY, ACTIVITY_TIMEOUT

WORKFLOW_TYPE = "promotion_rollout"
WORKFLOW_PREFIX = "promotion-rollout-"
_EVENT_ID = re.compile(r"^[A-Za-z0-9._:-]{1,60}$")


@dataclass
class PromotionRolloutInput:
    """One ``ModelPromoted``: the model now in ``stage``, and the one that held it before."""

    model: str
    """``name:version``."""
    stage: str
    previous: str = ""
    """``name:version`` of the stage's earlier holder; empty if none."""
    is_rollback: bool = False
    event_id: str = ""
    poll_s: float = 2.0


@dataclass
class PromotionRolloutResult:
    served: str = ""
    """The version whose replicas this rollout made sure of (empty: none holds the stage)."""
    deployment: str = ""
    ready: bool = False
    message: str = ""
    drained: list[str] = field(default_factory=list)
    """Deployments of the losing versions that were undeployed."""
    kept: list[str] = field(default_factory=list)
    """Versions that may have lost but were kept, each with why."""


def validate_promotion_rollout(params: PromotionRolloutInput) -> None:
    for path, value in (("input.model", params.model), ("input.previous", params.previous)):
        try:
            ModelRef.parse_optional(value)
        except ValueError as exc:
            raise errors.ValidationError(path, str(exc)) from None
    if not params.model:
        raise errors.ValidationError("input.model", "must not be empty")
    if params.stage not in SERVING_STAGES:
        raise errors.ValidationError("input.stage", f"must be one of {', '.join(SERVING_STAGES)}")
    if params.event_id and not _EVENT_ID.match(params.event_id):
        raise errors.ValidationError("input.event_id", "must be 1-60 letters, digits, '.', '_', ':' or '-'")
    if not 0.1 <= params.poll_s <= 600:
        raise errors.ValidationError("input.poll_s", "must be between 0.1 and 600")


def workflow_id_of(event_id: str) -> str:
    return WORKFLOW_PREFIX + event_id


@workflow.defn(name=WORKFLOW_TYPE)
class PromotionRolloutWorkflow:
    """Steps 1-2 of the module docstring."""

    async def _call(self, method: Callable[..., Awaitable[Any]], *args: object) -> Any:
        return await workflow.execute_activity_method(
            method, args=list(args), start_to_close_timeout=ACTIVITY_TIMEOUT, retry_policy=ACTIVITY_RETRY
        )

    async def _stage_of(self, model: str) -> str:
        ref = ModelRef.parse(model)
        state: RolloutState = await self._call(EvalActivities.rollout_state, ModelId(ref.name, ref.version))
        return state.stage

    @workflow.run
    async def run(self, params: PromotionRolloutInput) -> PromotionRolloutResult:
        result = PromotionRolloutResult()
        losers = [params.previous] if params.previous and params.previous != params.model else []
        # 1. The stage's holder, when the event's model still is.
        if await self._stage_of(params.model) == params.stage:
            ref = ModelRef.parse(params.model)
            uri: str = await self._call(EvalActivities.model_uri, ModelId(ref.name, ref.version))
            if not uri:
                result.message = f"{params.model} is not in the registry"
            else:
                served = await serve_version(self._call, params.model, uri, params.poll_s)
                if not served.deployment:
                    result.message = "promotions roll no replicas here"
                    return result
                result.served, result.deployment = params.model, served.deployment
                result.ready, result.message = served.ready, served.message
        else:
            losers.append(params.model)
        # 2. The versions that may have lost.
        for loser in losers:
            drained, kept = await drain_loser(self._call, loser, params.poll_s)
            result.drained += drained
            if kept:
                result.kept.append(kept)
        return result
