"""Replicas for a promotion, as workflow code (deterministic: durable timers, every call through an
activity of :mod:`forge_orchestrator.deploy.promotion`). Used by ``eval_and_promote``, by
``promotion_rollout`` (:mod:`forge_orchestrator.deploy.promoted`, every ``ModelPromoted``) and by
``synthetic`` (:mod:`forge_orchestrator.synthetic.workflow`: its student, deployed as a version of
the run's own with steps 1 and 2 around its sampling):

1. :func:`serve_version` before a version is promoted to canary (or production): its deployment
   exists and every replica is in the gateway's pool, so the split that the promotion's
   ``ModelPromoted`` sets up only ever sends traffic to replicas that answer;
2. :func:`drain_version` once a version has lost (a canary rolled back, or the production model a
   canary replaced): first until no gateway alias sends it traffic any more (the rollback's or
   promotion's ``ModelPromoted`` has reached the gateway, bounded by ``ROUTED_WAIT_S``), then its
   deployments are undeployed (each drains its replicas out of the pool before stopping them);
3. :func:`drain_loser`, step 2 for a promotion someone else made: a version that still holds a
   serving stage in the registry is kept (with the reason); any other is drained as in step 2.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from forge_kit.modelref import ModelRef
    from forge_orchestrator.deploy.promotion import Drained, PromotionActivities, Served, ServeInput
    from forge_orchestrator.eval_activities import EvalActivities, ModelId, RolloutState

#: The longest a loser's drain waits for the gateway to stop routing to it.
ROUTED_WAIT_S = 60.0
#: Registry stages that send a model traffic: a version holding one keeps its replicas.
SERVING_STAGES = ("canary", "production")

Call = Callable[..., Awaitable[Any]]


async def serve_version(call: Call, model: str, uri: str, poll_s: float) -> Served:
    """Step 1: the deployment serving ``model``, ready, or not ready once its timeout passed
    (``ready`` False, ``message`` why); ``deployment`` empty when promotions deploy nothing."""
    served: Served = await call(PromotionActivities.serve, ServeInput(model, uri))
    if not served.deployment:
        return served
    created = served.created
    deadline = workflow.now() + timedelta(seconds=served.ready_timeout_s)
    while not served.ready and workflow.now() < deadline:
        await workflow.sleep(timedelta(seconds=poll_s))
        served = await call(PromotionActivities.status, served.deployment)
    served.created = created
    return served


async def drain_version(call: Call, model: str, poll_s: float) -> list[str]:
    """Step 2: the deployments of ``model`` that were undeployed."""
    await _unrouted(call, model, poll_s)
    drained: Drained = await call(PromotionActivities.drain, model)
    return drained.deployments


async def drain_loser(call: Call, model: str, poll_s: float) -> tuple[list[str], str]:
    """Step 3: (the deployments of ``model`` that were undeployed, why it was kept instead)."""
    ref = ModelRef.parse(model)
    state: RolloutState = await call(EvalActivities.rollout_state, ModelId(ref.name, ref.version))
    if state.stage in SERVING_STAGES:
        return [], f"{model} holds {state.stage}"
    # The registry is the truth; the gateway's aliases follow it by events. A stage alias the
    # registry no longer backs (``canary`` still naming a canary promoted on to production, for
    # which no event clears ``canary``) must not keep a version's replicas forever: as in
    # :func:`drain_version`, the wait is bounded, then it is drained.
    await _unrouted(call, model, poll_s)
    drained: Drained = await call(PromotionActivities.drain, model)
    return drained.deployments, ""


async def _unrouted(call: Call, model: str, poll_s: float) -> None:
    deadline = workflow.now() + timedelta(seconds=ROUTED_WAIT_S)
    while workflow.now() < deadline and await call(PromotionActivities.routed, model):
        await workflow.sleep(timedelta(seconds=poll_s))
