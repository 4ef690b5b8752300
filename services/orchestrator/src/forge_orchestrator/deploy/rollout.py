"""Replicas for a promotion, as workflow code (deterministic: durable timers, every call through an
activity of :mod:`forge_orchestrator.deploy.promotion`). Used by ``eval_and_promote``:

1. :func:`serve_version` before a version is promoted to canary (or production): its deployment
   exists and every replica is in the gateway's pool, so the split that the promotion's
   ``ModelPromoted`` sets up only ever sends traffic to replicas that answer;
2. :func:`drain_version` once a version has lost (a canary rolled back, or the production model a
   canary replaced): first until no gateway alias sends it traffic any more (the rollback's or
   promotion's ``ModelPromoted`` has reached the gateway, bounded by ``ROUTED_WAIT_S``), then its
   deployments are undeployed (each drains its replicas out of the pool before stopping them).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from forge_orchestrator.deploy.promotion import Drained, PromotionActivities, Served, ServeInput

#: The longest a loser's drain waits for the gateway to stop routing to it.
ROUTED_WAIT_S = 60.0

Call = Callable[..., Awaitable[Any]]


async def serve_version(call: Call, model: str, uri: str, poll_s: float) -> Served:
    """Step 1: the deployment serving ``model``, ready, or not ready once its timeout passed
    (``ready`` False, ``message`` why); ``deployment`` empty when promotions deploy nothing."""
    served: Served = await call(PromotionActivities.serve, ServeInput(model, uri))
    if not served.deployment:
        return served
    deadline = workflow.now() + timedelta(seconds=served.ready_timeout_s)
    while not served.ready and workflow.now() < deadline:
        await workflow.sleep(timedelta(seconds=poll_s))
        served = await call(PromotionActivities.status, served.deployment)
    return served


async def drain_version(call: Call, model: str, poll_s: float) -> list[str]:
    """Step 2: the deployments of ``model`` that were undeployed."""
    deadline = workflow.now() + timedelta(seconds=ROUTED_WAIT_S)
    while workflow.now() < deadline and await call(PromotionActivities.routed, model):
        await workflow.sleep(timedelta(seconds=poll_s))
    drained: Drained = await call(PromotionActivities.drain, model)
    return drained.deployments
