"""Scheduler domain logic: teams, quotas and tokens, the job lifecycle, nodes, job watches.

Every state change of a job is written together with its ``JobStateChanged`` event in one
transaction (the outbox), then broadcast to in-process watchers once committed; commands for
agents (start, preempt, cancel) are sent through the :class:`~forge_scheduler.hub.AgentHub` only
after that commit. Placement and preemption decisions come from the scheduling loop
(:mod:`forge_scheduler.scheduling`), which applies the policy engine's cycle through this class.
It owns the job lifecycle and composes three collaborators: ``teams`` (:class:`.teams.Teams`:
teams, quotas, team tokens), ``nodes`` (:class:`.nodes.Nodes`: registration, heartbeats, the
GPUs jobs hold) and ``watches`` (:class:`.watches.Watches`: every committed job change to its
watchers). It takes and returns the records of :mod:`.records` and store rows, and sends agents
the commands of :mod:`.commands`: :mod:`forge_scheduler.api` owns every translation to and from
gRPC messages.

A job's replicas are grouped by node: one StartJob per node, with all of the job's GPU indices
on that node (torchrun runs one worker per GPU). ``replica_states`` tracks each node's last
report; the job succeeds when every node succeeded, fails when one fails, and returns to the
queue when its replicas were preempted or its node was lost.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import re
import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

import sqlalchemy as sa
import structlog
from forge.events.v1 import events_pb2
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm.exc import StaleDataError

from forge_kit import errors
from forge_kit.db import Database, utcnow
from forge_kit.events import stage_event
from forge_kit.grpckit import current_principal
from forge_kit.stats import percentile
from forge_scheduler.commands import CancelJob
from forge_scheduler.hub import AgentHub
from forge_scheduler.jobspec import JobSpec
from forge_scheduler.messages import routing_to_proto
from forge_scheduler.nodes import Nodes, holding_jobs, used_gpu_indices
from forge_scheduler.policy import never_fits
from forge_scheduler.policy_view import epoch, policy_job, policy_node
from forge_scheduler.records import ClusterView, QueueStats, ReplicaReport
from forge_scheduler.states import (
    ACTIVE,
    CANCELLED,
    FAILED,
    PENDING,
    PREEMPTED,
    REPLICA_ENDED,
    RUNNING,
    SCHEDULED,
    SUCCEEDED,
    TERMINAL,
    UNSPECIFIED,
)
from forge_scheduler.store import JobRow, NodeRow, QuotaRow, TeamRow, TeamUsageRow
from forge_scheduler.teams import Teams
from forge_scheduler.validation import validate_name, validate_spec
from forge_scheduler.watches import Watches, visible_team

__all__ = [
    "ACTIVE",
    "CANCELLED",
    "PENDING",
    "SCHEDULED",
    "ClusterView",
    "SchedulerService",
    "epoch",
    "holding_jobs",
    "policy_job",
    "policy_node",
    "retry_on_conflict",
    "used_gpu_indices",
]


log = structlog.get_logger(__name__)
T = TypeVar("T")

#: Times a unit of work on jobs runs when other units keep changing its rows under it.
WRITE_ATTEMPTS = 5


async def retry_on_conflict(unit: Callable[[], Awaitable[T]], what: str) -> T:
    """Run ``unit`` (one database session and what follows its commit) again while its commit
    finds a job row changed since it was read (``JobRow.version``); nothing of a failed attempt
    was committed or sent. Gives up after ``WRITE_ATTEMPTS``."""
    for attempt in range(1, WRITE_ATTEMPTS + 1):
        try:
            return await unit()
        except StaleDataError:
            if attempt == WRITE_ATTEMPTS:
                raise
            log.info("scheduler.write_conflict", unit=what, attempt=attempt)
            await asyncio.sleep(0.005 * attempt)
    raise AssertionError("unreachable")


def authorize_team(team: str, action: str) -> None:
    """A team token may act only for its own team; admins (the service token) for any."""
    principal = current_principal()
    if principal is not None and not principal.is_admin and principal.team != team:
        raise errors.PermissionDeniedError(f"{principal.name} may not {action} jobs of team {team!r}")


def _visible(job: JobRow) -> JobRow:
    """``job``, unless the caller is another team's token: then NOT_FOUND, as a missing job."""
    principal = current_principal()
    if principal is not None and not principal.is_admin and principal.team != job.team:
        raise errors.NotFoundError(f"job {job.id!r} not found")
    return job


def _by_admin() -> bool:
    """Whether the caller is an admin (a service token), or no authentication is in force."""
    principal = current_principal()
    return principal is None or principal.is_admin


#: A serving replica's URL as an agent reports it: http(s), a host name or address, a port.
ENDPOINT = re.compile(r"https?://[A-Za-z0-9.:\[\]-]{1,253}:[0-9]{1,5}")


class SchedulerService:
    """Owns the scheduler's database; every public method (its own and its collaborators') is one
    transaction."""

    def __init__(
        self,
        db: Database,
        *,
        producer: str = "scheduler",
        clock: Callable[[], dt.datetime] = utcnow,
        on_commit: Callable[[], None] = lambda: None,
        watch_queue_size: int = 1000,
        hub: AgentHub | None = None,
    ) -> None:
        self._db = db
        self._producer = producer
        self._clock = clock
        self.hub = hub or AgentHub()
        self.cluster = ClusterView()
        self._wake: Callable[[], None] = lambda: None
        self.teams = Teams(db, clock, self._woken)
        self.nodes = Nodes(db, clock, self._woken)
        self.watches = Watches(db, on_commit, watch_queue_size)

    @property
    def db(self) -> Database:
        return self._db

    def now(self) -> dt.datetime:
        return self._clock()

    def on_change(self, wake: Callable[[], None]) -> None:
        """``wake`` is called after every change that may let a job start (the scheduling loop)."""
        self._wake = wake

    def _woken(self) -> None:
        """The collaborators' wake: whatever :meth:`on_change` set last."""
        self._wake()

    def committed(self, job: JobRow) -> None:
        """``job``'s change is committed: its watchers hear of it (:meth:`.watches.Watches.committed`)."""
        self.watches.committed(job)

    # --- jobs --------------------------------------------------------------------------------

    async def submit_job(self, spec: JobSpec, request_id: str = "", *, on_behalf_of: str = "") -> JobRow:
        """Queue a job. A retry with the same ``request_id`` returns the job created first.
        ``on_behalf_of`` names the team whose rights an admin caller (the orchestrator, for a
        team's caller) acts with: the job must be that team's."""
        validate_spec(spec)
        authorize_team(spec.team, "submit")
        if on_behalf_of:
            validate_name("on_behalf_of", on_behalf_of)
            authorize_team(on_behalf_of, "submit")
            if spec.team != on_behalf_of:
                raise errors.PermissionDeniedError(
                    f"a submission on behalf of team {on_behalf_of!r} may not submit jobs of team {spec.team!r}"
                )
        async with self._db.session() as session:
            if request_id:
                found = await session.scalar(sa.select(JobRow).where(JobRow.request_id == request_id))
                if found is not None:
                    return found
            if await session.get(TeamRow, spec.team) is None:
                raise errors.NotFoundError(f"team {spec.team!r} not found")
            now = self._clock()
            job = JobRow(
                id=f"job-{uuid.uuid4().hex[:12]}",
                request_id=request_id or None,
                name=spec.name,
                team=spec.team,
                priority_class=spec.priority_class,
                gpu_type=spec.gpu_type,
                gpus_per_replica=spec.gpus_per_replica,
                replicas=spec.tasks,
                spec=spec.to_json(),
                state=PENDING,
                message="queued",
                assigned_nodes=[],
                preemption_count=0,
                created_at=now,
                queued_at=now,
                placement=spec.effective_placement.value,
                min_runtime_s=float(spec.min_runtime_s),
                checkpointable=spec.checkpointable,
                checkpoint_interval_s=float(spec.checkpoint_interval_s),
                attempt=0,
                borrowed=False,
                # A submission on a team's behalf is that team's, whoever relays it.
                submitted_by_admin=_by_admin() and not on_behalf_of,
                attained_gpu_s=0.0,
                pending_reason="waiting for the next scheduling cycle",
            )
            if job.gpus_per_replica > 0:
                await self._refuse_if_never_fits(session, job)
            session.add(job)
            await session.flush()
            await self.stage_transition(session, job, UNSPECIFIED, "submitted")
        self.committed(job)
        return job

    async def _refuse_if_never_fits(self, session: AsyncSession, job: JobRow) -> None:
        """A gang larger than anything the registered nodes could ever hold is refused at submit
        rather than queued forever. With no node registered yet nothing can be judged."""
        nodes = [policy_node(n) for n in (await session.scalars(sa.select(NodeRow))).all() if n.gpus]
        if not nodes:
            return
        reason = never_fits(policy_job(job), nodes)
        if reason is not None:
            raise errors.ConflictError(f"job can never be placed on this cluster: {reason}")

    async def get_job(self, job_id: str) -> JobRow:
        """The job; another team's job answers NOT_FOUND to a team token, as a missing one does."""
        async with self._db.session() as session:
            return _visible(await _job(session, job_id))

    async def list_jobs(
        self, team: str, states: Iterable[int], page_size: int, offset: int
    ) -> tuple[list[JobRow], int]:
        team = visible_team(team)
        query = sa.select(JobRow)
        if team:
            query = query.where(JobRow.team == team)
        states = list(states)
        if states:
            query = query.where(JobRow.state.in_(states))
        async with self._db.session() as session:
            total = int(await session.scalar(sa.select(sa.func.count()).select_from(query.subquery())) or 0)
            rows = (
                await session.scalars(
                    query.order_by(JobRow.created_at.desc(), JobRow.id).offset(offset).limit(page_size)
                )
            ).all()
        return list(rows), total

    async def cancel_job(self, job_id: str, reason: str) -> JobRow:
        """Cancel a job; idempotent for jobs already finished. Running replicas are told to stop;
        their GPUs stay taken until each agent reports the replica ended."""
        return await retry_on_conflict(lambda: self._cancel_job(job_id, reason), "cancel_job")

    async def _cancel_job(self, job_id: str, reason: str) -> JobRow:
        async with self._db.session() as session:
            job = await _job(session, job_id)
            _visible(job)
            if job.state in TERMINAL:
                return job
            previous = job.state
            job.state = CANCELLED
            job.message = reason or "cancelled by user"
            job.pending_reason = ""
            job.finished_at = self._clock()
            stopping = self.release(job)
            await self.stage_transition(session, job, previous, job.message)
        self.committed(job)
        for node in stopping:
            self.hub.send(node, CancelJob(job.id, job.message))
        return job

    def release(self, job: JobRow) -> list[str]:
        """Take the job off its placement: replicas still live move to ``draining`` (their GPUs
        stay taken until they report an end). Returns the nodes with a live replica."""
        live = [
            [node, gpus]
            for node, gpus in (job.slots or [])
            if (job.replica_states or {}).get(node) not in REPLICA_ENDED
        ]
        if live:
            job.draining = [*(job.draining or []), *live]
        job.slots = None
        job.replica_states = None
        job.endpoints = None
        job.preempt_by = None
        return sorted({node for node, _ in live})

    async def update_job_status(self, node_name: str, update: ReplicaReport) -> JobRow | None:
        """Apply an agent's report about the job's replica on ``node_name``.

        1. A report for a replica that is draining (an earlier placement) frees its GPUs.
        2. Reports from nodes the job is not placed on, or for jobs not placed, are ignored.
        3. RUNNING: the job runs (first replica to start). FAILED: the job fails and the other
           replicas are cancelled. PREEMPTED / CANCELLED while the job is active: once no
           replica is live, the job returns to the queue. SUCCEEDED: when every replica did.

        Reports of one job's replicas arrive on their agents' streams side by side: each runs as
        one unit on the row as committed, again if another report changed it meanwhile.
        """
        return await retry_on_conflict(lambda: self._update_job_status(node_name, update), "job_status")

    async def _update_job_status(self, node_name: str, update: ReplicaReport) -> JobRow | None:
        now = self._clock()
        stop: list[str] = []
        changed: JobRow | None = None
        async with self._db.session() as session:
            job = await session.get(JobRow, update.job_id)
            if job is None:
                return None
            if update.state in REPLICA_ENDED and job.draining:
                job.draining = [s for s in job.draining if s[0] != node_name] or None
                self._wake()
            placed = {node for node, _ in (job.slots or [])}
            if job.state not in ACTIVE or node_name not in placed:
                return None
            if update.last_checkpoint_at is not None:
                job.last_checkpoint_at = update.last_checkpoint_at
            states = dict(job.replica_states or {})
            states[node_name] = int(update.state)
            job.replica_states = states
            previous = job.state
            detail = update.message or f"reported by {node_name}"
            if update.state == RUNNING and ENDPOINT.fullmatch(update.endpoint):
                job.endpoints = {**(job.endpoints or {}), node_name: update.endpoint}
            if update.state == RUNNING:
                if job.state != RUNNING:
                    job.state = RUNNING
                    job.started_at = job.started_at or now
                    job.message = detail
            elif update.state == FAILED:
                job.state = FAILED
                job.message = f"replica on {node_name} failed: {detail}"
                job.finished_at = now
                self._account(job, now)
                stop = self.release(job)
            elif update.state in (PREEMPTED, CANCELLED):
                # The gang is broken: back to the queue at once. Live replicas keep their GPUs
                # (draining) until they report; unless a preemption already told them, stop them.
                planned = job.preempt_by is not None
                stopping = self.requeue(job, now, f"preempted on {node_name} ({detail}); back in the queue")
                stop = [] if planned else stopping
            elif update.state == SUCCEEDED and all(states.get(node) == SUCCEEDED for node in placed):
                job.state = SUCCEEDED
                job.message = detail
                job.finished_at = now
                self._account(job, now)
                self.release(job)
            if job.state != previous:
                await self.stage_transition(session, job, previous, job.message)
                changed = job
        if changed is not None:
            self.committed(changed)
            self._wake()
        for node in stop:
            self.hub.send(node, CancelJob(update.job_id, "another replica failed"))
        return changed

    def _account(self, job: JobRow, now: dt.datetime) -> None:
        """Add the ending attempt's GPU-seconds to what the job has attained."""
        since = job.started_at or now
        job.attained_gpu_s += job.gpus_per_replica * job.replicas * max(0.0, (now - since).total_seconds())

    def requeue(self, job: JobRow, now: dt.datetime, reason: str) -> list[str]:
        """Back to PENDING (preempted or node lost): keeps its attained service and attempt count.
        Returns the nodes that still run a replica of it (to be cancelled)."""
        self._account(job, now)
        stopping = self.release(job)
        job.state = PENDING
        job.message = reason
        job.pending_reason = "requeued; waiting for the next scheduling cycle"
        job.preemption_count += 1
        job.queued_at = now
        job.started_at = None
        return stopping

    async def queue_stats(self, team: str = "") -> list[QueueStats]:
        async with self._db.session() as session:
            teams = (
                [team]
                if team
                else list((await session.scalars(sa.select(TeamRow.name).order_by(TeamRow.name))).all())
            )
            stats = []
            for name in teams:
                rows = (await session.scalars(sa.select(JobRow).where(JobRow.team == name))).all()
                waits = sorted(
                    (r.started_at - r.created_at).total_seconds() for r in rows if r.started_at is not None
                )
                quotas = (await session.scalars(sa.select(QuotaRow).where(QuotaRow.team == name))).all()
                usage = await session.get(TeamUsageRow, name)
                guaranteed = sum(q.guaranteed_gpus for q in quotas)
                in_use = sum(r.gpus_per_replica * r.replicas for r in rows if r.state in ACTIVE)
                share = self.cluster.fair_shares.get(name, 0.0)
                stats.append(
                    QueueStats(
                        team=name,
                        pending_jobs=sum(1 for r in rows if r.state == PENDING),
                        running_jobs=sum(1 for r in rows if r.state in ACTIVE),
                        gpus_in_use=in_use,
                        queue_time_p50_s=percentile(waits, 50),
                        queue_time_p95_s=percentile(waits, 95),
                        guaranteed_gpus=guaranteed,
                        borrowed_gpus=max(0, in_use - guaranteed),
                        fair_share_gpus=share,
                        share_ratio=in_use / share if share > 0 else 0.0,
                        decayed_usage_gpu_hours=(usage.decayed_gpu_s / 3600.0) if usage else 0.0,
                    )
                )
        return stats

    async def stage_transition(self, session: AsyncSession, job: JobRow, previous: int, reason: str) -> None:
        spec = job.job_spec
        event = events_pb2.JobStateChanged(
            job_id=job.id,
            team=job.team,
            name=job.name,
            previous_state=previous,  # type: ignore[arg-type]
            state=job.state,  # type: ignore[arg-type]
            reason=reason,
            node_names=list(job.assigned_nodes),
            labels=dict(spec.labels),
            routing=routing_to_proto(spec.routing) if spec.routing is not None else None,
        )
        await stage_event(session, event, producer=self._producer, key=job.id)


async def _job(session: AsyncSession, job_id: str) -> JobRow:
    if not job_id:
        raise errors.ValidationError("job_id", "must not be empty")
    job = await session.get(JobRow, job_id)
    if job is None:
        raise errors.NotFoundError(f"job {job_id!r} not found")
    return job
