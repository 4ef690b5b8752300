"""The ``TrainingMetrics`` consumer's handler for sweeps: a trial's metric reaches its sweep.

A metrics event names its job; the job's workflow is known from the job's recorded
``JobStateChanged`` events (``job_events``, written by the job-event handler when the job
started). Only a workflow started as a sweep carries the followed metric's name in its memo
(:data:`MEMO_METRIC`); for one, the event's value of that metric, if it has one, is signalled
as ``trial_metric`` (job, step, value, event id), and so is its value after a rung's cooldown
branch (``cooldown_<metric>``, flagged ``cooldown``). Other workflows get nothing, and a sweep gets
one signal per evaluation rather than one per logged step. What each workflow follows is
remembered (a bounded map), so the workflow is described once, not per event.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Protocol

import sqlalchemy as sa
import structlog
from forge.events.v1 import events_pb2
from google.protobuf.message import Message
from sqlalchemy.ext.asyncio import AsyncSession
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from forge_experiments.sweepspace import COOLDOWN_PREFIX
from forge_orchestrator.event_handlers import signal_if_running
from forge_orchestrator.store import JobEventRow
from forge_orchestrator.sweep.workflow import MEMO_METRIC, METRIC_SIGNAL, TrialMetric

log = structlog.get_logger(__name__)
_CACHE = 4096
Handler = Callable[[Message, AsyncSession], Awaitable[None]]


class SweepSignaller(Protocol):
    async def followed_metric(self, workflow_id: str) -> str:
        """The metric the workflow follows ("" for a workflow that is no sweep, or is gone)."""

    async def trial_metric(self, workflow_id: str, metric: TrialMetric) -> bool:
        """Signal; False when the workflow no longer runs. Raises when delivery should be retried."""


class TemporalSweepSignaller:
    def __init__(self, client: Client, *, rpc_timeout_s: float = 10.0) -> None:
        self._client = client
        self._rpc_timeout = timedelta(seconds=rpc_timeout_s)

    async def followed_metric(self, workflow_id: str) -> str:
        handle = self._client.get_workflow_handle(workflow_id)
        try:
            description = await handle.describe(rpc_timeout=self._rpc_timeout)
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                return ""
            raise
        if description.workflow_type != "sweep":
            return ""
        value = await description.memo_value(MEMO_METRIC, default="")
        return value if isinstance(value, str) else ""

    async def trial_metric(self, workflow_id: str, metric: TrialMetric) -> bool:
        return await signal_if_running(
            self._client, workflow_id, METRIC_SIGNAL, metric, rpc_timeout=self._rpc_timeout
        )


class MetricsHandler:
    """Consumer handler for ``TrainingMetrics`` (see the module docstring)."""

    def __init__(self, signaller: SweepSignaller, then: Handler | None = None) -> None:
        self._signaller = signaller
        self._then = then
        """The handler of every other event (the consumer's other handlers)."""
        self._followed: OrderedDict[str, str] = OrderedDict()

    async def _metric_of(self, workflow_id: str) -> str:
        if workflow_id in self._followed:
            self._followed.move_to_end(workflow_id)
            return self._followed[workflow_id]
        metric = await self._signaller.followed_metric(workflow_id)
        self._followed[workflow_id] = metric
        while len(self._followed) > _CACHE:
            self._followed.popitem(last=False)
        return metric

    async def handle(self, event: Message, session: AsyncSession) -> None:
        if not isinstance(event, events_pb2.TrainingMetrics):
            if self._then is not None:
                await self._then(event, session)
            return
        if not event.job_id:
            return
        workflow_id = (
            await session.execute(
                sa.select(JobEventRow.workflow_id).where(JobEventRow.job_id == event.job_id).limit(1)
            )
        ).scalar_one_or_none()
        if not workflow_id:
            return
        metric = await self._metric_of(workflow_id)
        if not metric:
            return
        for key, cooled in ((metric, False), (COOLDOWN_PREFIX + metric, True)):
            value = event.values.get(key)
            if value is None:
                continue
            # One event id per signal: the workflow drops a repeated id as a duplicate delivery.
            event_id = event.meta.event_id + ("/cooldown" if cooled and event.meta.event_id else "")
            delivered = await self._signaller.trial_metric(
                workflow_id,
                TrialMetric(event.job_id, int(event.step), float(value), event_id=event_id, cooldown=cooled),
            )
            log.info(
                "trial_metric.routed",
                workflow_id=workflow_id,
                job_id=event.job_id,
                step=event.step,
                cooldown=cooled,
                delivered=delivered,
            )
