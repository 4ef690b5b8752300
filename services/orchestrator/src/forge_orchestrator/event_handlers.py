"""The orchestrator's event handlers: what its Kafka consumer does with each event, in the consumer's transaction.

:class:`JobEventHandler`: a ``JobStateChanged`` event whose job carries a ``workflow_id`` label is
recorded in ``job_events`` and signalled to that workflow. :class:`CheckpointHandler` hands a
published checkpoint to that workflow and starts its eval-and-promote (unless the job is labelled
``auto_eval=false``). :class:`PromotionHandler` starts a ``promotion_rollout`` workflow for each
``ModelPromoted``. :class:`EventHandlers` sends each event to the handler of its type.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import sqlalchemy as sa
import structlog
from forge.events.v1 import events_pb2
from google.protobuf.message import Message
from sqlalchemy.ext.asyncio import AsyncSession
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from forge_kit.db import utcnow
from forge_kit.modelref import ModelRef, label
from forge_orchestrator.activities import state_name
from forge_orchestrator.inbox import JOB_EVENT_SIGNAL, JobEvent
from forge_orchestrator.routing import Routing
from forge_orchestrator.store import JobEventRow
from forge_orchestrator.training.model import CHECKPOINT_SIGNAL, CheckpointInfo

log = structlog.get_logger(__name__)


class WorkflowSignaller(Protocol):
    """Delivers a job event to a workflow. Called by :class:`JobEventHandler` once per new event."""

    async def job_event(self, workflow_id: str, event: JobEvent) -> bool:
        """Signal ``event``; False when the workflow no longer runs (closed or unknown). Raises
        when delivery failed and should be retried."""

    async def checkpoint(self, workflow_id: str, checkpoint: CheckpointInfo) -> bool:
        """Signal a published checkpoint of the workflow's job, with the same contract."""


class TemporalSignaller:
    """:class:`WorkflowSignaller` through the Temporal client."""

    def __init__(self, client: Client, *, rpc_timeout_s: float = 10.0) -> None:
        self._client = client
        self._rpc_timeout = timedelta(seconds=rpc_timeout_s)

    async def job_event(self, workflow_id: str, event: JobEvent) -> bool:
        return await self._signal(workflow_id, JOB_EVENT_SIGNAL, event)

    async def checkpoint(self, workflow_id: str, checkpoint: CheckpointInfo) -> bool:
        return await self._signal(workflow_id, CHECKPOINT_SIGNAL, checkpoint)

    async def _signal(self, workflow_id: str, name: str, payload: object) -> bool:
        return await signal_if_running(
            self._client, workflow_id, name, payload, rpc_timeout=self._rpc_timeout
        )


async def signal_if_running(
    client: Client, workflow_id: str, name: str, payload: object, *, rpc_timeout: timedelta
) -> bool:
    """Signal ``name`` with ``payload`` to the workflow: False when it no longer runs (Temporal
    answers NOT_FOUND for a closed or unknown one), so the event is dropped, not retried forever.
    Any other failure raises, and the consumer retries. Every handler that signals uses this."""
    handle = client.get_workflow_handle(workflow_id)
    try:
        await handle.signal(name, payload, rpc_timeout=rpc_timeout)
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            return False
        raise
    return True


class JobEventHandler:
    """The job-event consumer's handler: record, then signal, in the consumer's transaction.

    The row and the consumer's processed-event mark commit only after the signal went out, so a
    failed signal is retried; a crash after signalling but before commit signals again, which the
    workflow ignores by event id.
    """

    def __init__(self, signaller: WorkflowSignaller) -> None:
        self._signaller = signaller

    async def handle(self, event: Message, session: AsyncSession) -> None:
        if not isinstance(event, events_pb2.JobStateChanged):
            return
        routing = Routing.read(event.routing if event.HasField("routing") else None, event.labels)
        workflow_id = routing.workflow_id
        if not workflow_id:
            return
        state = state_name(event.state)
        session.add(
            JobEventRow(
                event_id=event.meta.event_id,
                job_id=event.job_id,
                workflow_id=workflow_id,
                state=state,
                auto_eval=routing.auto_eval,
                received_at=utcnow(),
            )
        )
        await session.flush()
        delivered = await self._signaller.job_event(
            workflow_id,
            JobEvent(job_id=event.job_id, state=state, event_id=event.meta.event_id, reason=event.reason),
        )
        log.info(
            "job_event.routed", workflow_id=workflow_id, job_id=event.job_id, state=state, delivered=delivered
        )


class WorkflowStarter(Protocol):
    """Starts a workflow by type (the :class:`OrchestratorService`); used by event handlers."""

    async def start_workflow(
        self, workflow_type: str, data: Mapping[str, object], workflow_id: str = ""
    ) -> tuple[str, str]:
        """Start it (idempotent on ``workflow_id``); returns (workflow id, run id)."""


class CheckpointHandler:
    """Consumer handler for ``CheckpointPublished``: each published checkpoint starts one
    eval-and-promote workflow, whose id is derived from the checkpoint so a redelivered event
    finds the workflow already there instead of evaluating twice.

    A job labelled ``auto_eval=false`` (:data:`AUTO_EVAL_LABEL`; the RLHF loop's reward-model and
    DPO jobs) is skipped: its submitter evaluates its checkpoints. The label is known from the
    job's ``JobStateChanged`` events, which the scheduler publishes when the job starts, well
    before the job can publish a checkpoint."""

    def __init__(
        self,
        starter: WorkflowStarter,
        *,
        suite: str,
        limit: int,
        tier: str = "full",
        signaller: WorkflowSignaller | None = None,
    ) -> None:
        self._starter = starter
        self._suite = suite
        self._limit = limit
        self._tier = tier
        self._signaller = signaller

    async def handle(self, event: Message, session: AsyncSession) -> None:
        if not isinstance(event, events_pb2.CheckpointPublished) or not event.uri:
            return
        # The workflow that submitted the job (if one did), from the job's recorded events.
        row = (
            (
                await session.execute(
                    sa.select(JobEventRow.workflow_id, JobEventRow.auto_eval)
                    .where(JobEventRow.job_id == event.job_id)
                    .limit(1)
                )
            ).first()
            if event.job_id
            else None
        )
        owner, auto_eval = (row.workflow_id, row.auto_eval) if row is not None else ("", True)
        # 1. That workflow (a training workflow) learns of its checkpoint.
        if owner and self._signaller is not None:
            await self._signaller.checkpoint(
                owner,
                CheckpointInfo(
                    job_id=event.job_id,
                    run_id=event.run_id,
                    step=event.step,
                    uri=event.uri,
                    manifest_uri=event.manifest_uri,
                    metrics=dict(event.metrics),
                    event_id=event.meta.event_id,
                ),
            )
        # 2. Unless its submitter evaluates it itself (the RLHF loop: reward models are gated on
        # held-out pairs, policies handed over after the drift check), eval-and-promote.
        if not auto_eval:
            log.info("checkpoint.eval_skipped", workflow_id=owner, job_id=event.job_id, uri=event.uri)
            return
        name = event.run_id or event.job_id
        version = f"step-{event.step}"
        workflow_id = f"eval-{name}-{version}"[:80]
        data: dict[str, object] = {
            "model_name": name,
            "model_version": version,
            "uri": event.uri,
            "suite": self._suite,
            "limit": self._limit,
            "tier": self._tier,
        }
        started, _ = await self._starter.start_workflow("eval_and_promote", data, workflow_id)
        log.info("checkpoint.eval_started", workflow_id=started, model=label(name, version), uri=event.uri)


class PromotionHandler:
    """Consumer handler for ``ModelPromoted`` (canary or production, made by anyone): starts the
    ``promotion_rollout`` workflow (:mod:`forge_orchestrator.deploy.promoted`) under an id derived
    from the event id, so a redelivered event finds it already started."""

    def __init__(self, starter: WorkflowStarter, *, poll_s: float = 2.0) -> None:
        self._starter = starter
        self._poll_s = poll_s

    async def handle(self, event: Message, session: AsyncSession) -> None:
        if not isinstance(event, events_pb2.ModelPromoted) or event.stage not in ("canary", "production"):
            return
        data: dict[str, object] = {
            "model": str(ModelRef.of(event.model)),
            "stage": event.stage,
            "previous": str(ModelRef.of(event.previous)) if event.HasField("previous") else "",
            "is_rollback": event.is_rollback,
            "event_id": event.meta.event_id,
            "poll_s": self._poll_s,
        }
        started, _ = await self._starter.start_workflow(
            "promotion_rollout", data, f"promotion-rollout-{event.meta.event_id}"
        )
        log.info("promotion.rollout_started", workflow_id=started, model=data["model"], stage=event.stage)


@dataclass(frozen=True)
class EventHandlers:
    """One consumer, several topics: each event goes to the handler of its type."""

    job_events: JobEventHandler
    checkpoints: CheckpointHandler
    promotions: PromotionHandler | None = None
    """None: promotions roll no replicas here."""

    async def handle(self, event: Message, session: AsyncSession) -> None:
        if isinstance(event, events_pb2.JobStateChanged):
            await self.job_events.handle(event, session)
        elif isinstance(event, events_pb2.CheckpointPublished):
            await self.checkpoints.handle(event, session)
        elif isinstance(event, events_pb2.ModelPromoted) and self.promotions is not None:
            await self.promotions.handle(event, session)
