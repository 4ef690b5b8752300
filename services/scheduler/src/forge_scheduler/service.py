"""Scheduler domain logic: teams and quotas, the job lifecycle, node registration, job watches.

Every state change of a job is written together with its ``JobStateChanged`` event in one
transaction (the outbox), then broadcast to in-process watchers once committed. Placement and
preemption policy plug in on top of these primitives.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import re
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field

import sqlalchemy as sa
from forge.common.v1 import common_pb2
from forge.events.v1 import events_pb2
from forge.scheduler.v1 import scheduler_pb2
from sqlalchemy.ext.asyncio import AsyncSession

from forge_kit import errors
from forge_kit.db import Database
from forge_kit.events import stage_event
from forge_scheduler.store import JobRow, NodeRow, QuotaRow, TeamRow, utcnow

JobState = common_pb2.JobState
PENDING, SCHEDULED, RUNNING = (
    JobState.JOB_STATE_PENDING,
    JobState.JOB_STATE_SCHEDULED,
    JobState.JOB_STATE_RUNNING,
)
TERMINAL = frozenset({JobState.JOB_STATE_SUCCEEDED, JobState.JOB_STATE_FAILED, JobState.JOB_STATE_CANCELLED})
ACTIVE = frozenset({SCHEDULED, RUNNING})
PRIORITY_CLASSES = ("production", "high", "normal", "preemptible")
_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


@dataclass(frozen=True)
class TeamView:
    """A team with its quotas, as returned to callers."""

    name: str
    display_name: str
    created_at: dt.datetime
    quotas: tuple[QuotaRow, ...]


@dataclass(frozen=True)
class QueueStats:
    """Queue figures of one team."""

    team: str
    pending_jobs: int = 0
    running_jobs: int = 0
    gpus_in_use: int = 0
    queue_time_p50_s: float = 0.0
    queue_time_p95_s: float = 0.0


@dataclass
class _Watcher:
    team: str
    job_ids: frozenset[str]
    queue: asyncio.Queue[JobRow | None] = field(default_factory=lambda: asyncio.Queue(maxsize=1000))

    def wants(self, job: JobRow) -> bool:
        return (not self.team or job.team == self.team) and (not self.job_ids or job.id in self.job_ids)


def validate_name(field_name: str, value: str) -> None:
    """Team and job names are DNS-label-like so they can become resource names downstream."""
    if not value:
        raise errors.ValidationError(field_name, "must not be empty")
    if not _NAME.match(value):
        raise errors.ValidationError(
            field_name, "must be lowercase letters, digits and '-', at most 63 characters"
        )


def validate_spec(spec: scheduler_pb2.JobSpec) -> None:
    """Reject a spec the scheduler could never run, naming the field."""
    validate_name("spec.name", spec.name)
    validate_name("spec.team", spec.team)
    if spec.priority_class not in PRIORITY_CLASSES:
        raise errors.ValidationError("spec.priority_class", f"must be one of {', '.join(PRIORITY_CLASSES)}")
    if spec.resources.gpu_count > 0 and not spec.resources.gpu_type:
        raise errors.ValidationError("spec.resources.gpu_type", "is required when gpu_count > 0")
    if spec.resources.gpu_count > 64:
        raise errors.ValidationError("spec.resources.gpu_count", "must be at most 64 per replica")
    if spec.replicas > 1024:
        raise errors.ValidationError("spec.replicas", "must be at most 1024")
    if not spec.command:
        raise errors.ValidationError("spec.command", "must not be empty")


class SchedulerService:
    """Owns the scheduler's database; every public method is one transaction."""

    def __init__(
        self,
        db: Database,
        *,
        producer: str = "scheduler",
        clock: Callable[[], dt.datetime] = utcnow,
        on_commit: Callable[[], None] = lambda: None,
        watch_queue_size: int = 1000,
    ) -> None:
        self._db = db
        self._producer = producer
        self._clock = clock
        self._on_commit = on_commit
        self._watch_queue_size = watch_queue_size
        self._watchers: list[_Watcher] = []

    # --- teams -------------------------------------------------------------------------------

    async def create_team(
        self, name: str, display_name: str, quotas: Iterable[scheduler_pb2.Quota]
    ) -> TeamView:
        validate_name("name", name)
        quotas = list(quotas)
        for i, quota in enumerate(quotas):
            _validate_quota(f"quotas[{i}]", quota)
        async with self._db.session() as session:
            if await session.get(TeamRow, name) is not None:
                raise errors.AlreadyExistsError(f"team {name!r} already exists")
            session.add(TeamRow(name=name, display_name=display_name or name, created_at=self._clock()))
            await session.flush()
            for quota in quotas:
                session.add(_quota_row(name, quota))
        return await self.get_team(name)

    async def get_team(self, name: str) -> TeamView:
        async with self._db.session() as session:
            return await _team_view(session, name)

    async def list_teams(self, page_size: int, offset: int) -> tuple[list[TeamView], int]:
        async with self._db.session() as session:
            total = int(await session.scalar(sa.select(sa.func.count()).select_from(TeamRow)) or 0)
            names = (
                await session.scalars(
                    sa.select(TeamRow.name).order_by(TeamRow.name).offset(offset).limit(page_size)
                )
            ).all()
            return [await _team_view(session, n) for n in names], total

    async def set_quota(self, team: str, quota: scheduler_pb2.Quota) -> TeamView:
        validate_name("team", team)
        _validate_quota("quota", quota)
        async with self._db.session() as session:
            if await session.get(TeamRow, team) is None:
                raise errors.NotFoundError(f"team {team!r} not found")
            existing = await session.get(QuotaRow, (team, quota.gpu_type))
            if existing is not None:
                await session.delete(existing)
                await session.flush()
            session.add(_quota_row(team, quota))
        return await self.get_team(team)

    # --- jobs --------------------------------------------------------------------------------

    async def submit_job(self, spec: scheduler_pb2.JobSpec, request_id: str = "") -> JobRow:
        """Queue a job. A retry with the same ``request_id`` returns the job created first."""
        validate_spec(spec)
        async with self._db.session() as session:
            if request_id:
                found = await session.scalar(sa.select(JobRow).where(JobRow.request_id == request_id))
                if found is not None:
                    return found
            if await session.get(TeamRow, spec.team) is None:
                raise errors.ValidationError("spec.team", f"team {spec.team!r} does not exist")
            job = JobRow(
                id=f"job-{uuid.uuid4().hex[:12]}",
                request_id=request_id or None,
                name=spec.name,
                team=spec.team,
                priority_class=spec.priority_class,
                gpu_type=spec.resources.gpu_type,
                gpus_per_replica=spec.resources.gpu_count,
                replicas=max(1, spec.replicas),
                spec=spec.SerializeToString(),
                state=PENDING,
                message="queued",
                assigned_nodes=[],
                preemption_count=0,
                created_at=self._clock(),
            )
            session.add(job)
            await session.flush()
            await self._stage_transition(session, job, JobState.JOB_STATE_UNSPECIFIED, "submitted")
        self._committed(job)
        return job

    async def get_job(self, job_id: str) -> JobRow:
        async with self._db.session() as session:
            return await _job(session, job_id)

    async def list_jobs(
        self, team: str, states: Iterable[int], page_size: int, offset: int
    ) -> tuple[list[JobRow], int]:
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
        """Cancel a job; idempotent for jobs already finished."""
        async with self._db.session() as session:
            job = await _job(session, job_id)
            if job.state in TERMINAL:
                return job
            previous = job.state
            job.state = JobState.JOB_STATE_CANCELLED
            job.message = reason or "cancelled by user"
            job.finished_at = self._clock()
            await self._stage_transition(session, job, previous, job.message)
        self._committed(job)
        return job

    async def update_job_status(self, node_name: str, update: scheduler_pb2.JobStatusUpdate) -> JobRow | None:
        """Apply an agent's report about a replica; ignores reports about finished jobs."""
        async with self._db.session() as session:
            job = await session.get(JobRow, update.job_id)
            if job is None or job.state in TERMINAL or update.state == job.state:
                return None
            previous = job.state
            job.state = update.state
            job.message = update.message or f"reported by {node_name}"
            if update.state == RUNNING and job.started_at is None:
                job.started_at = self._clock()
            if update.state in TERMINAL:
                job.finished_at = self._clock()
            await self._stage_transition(session, job, previous, job.message)
        self._committed(job)
        return job

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
                stats.append(
                    QueueStats(
                        team=name,
                        pending_jobs=sum(1 for r in rows if r.state == PENDING),
                        running_jobs=sum(1 for r in rows if r.state in ACTIVE),
                        gpus_in_use=sum(r.gpus_per_replica * r.replicas for r in rows if r.state in ACTIVE),
                        queue_time_p50_s=_percentile(waits, 0.50),
                        queue_time_p95_s=_percentile(waits, 0.95),
                    )
                )
        return stats

    # --- nodes -------------------------------------------------------------------------------

    async def register_node(self, request: scheduler_pb2.RegisterNode) -> NodeRow:
        """Create or resume a node by name; the node id is stable across reconnects."""
        if not request.node_name:
            raise errors.ValidationError("register_node.node_name", "must not be empty")
        async with self._db.session() as session:
            node = await session.scalar(sa.select(NodeRow).where(NodeRow.name == request.node_name))
            if node is None:
                node = NodeRow(node_id=f"node-{uuid.uuid4().hex[:12]}", name=request.node_name)
                session.add(node)
            node.gpus = [{"index": g.index, "type": g.type, "memory_mb": g.memory_mb} for g in request.gpus]
            node.node_group = request.topology.node_group
            node.rack = request.topology.rack
            node.nvlink_domain = request.topology.nvlink_domain
            node.labels = dict(request.labels)
            node.state = scheduler_pb2.NodeState.NODE_STATE_READY
            node.last_heartbeat_at = self._clock()
            node.running_job_ids = list(request.running_job_ids)
        return node

    async def heartbeat(self, node_name: str, running_job_ids: Iterable[str]) -> None:
        async with self._db.session() as session:
            node = await session.scalar(sa.select(NodeRow).where(NodeRow.name == node_name))
            if node is None:
                raise errors.NotFoundError(f"node {node_name!r} is not registered")
            node.last_heartbeat_at = self._clock()
            node.state = scheduler_pb2.NodeState.NODE_STATE_READY
            node.running_job_ids = list(running_job_ids)

    async def mark_node_lost(self, node_name: str) -> None:
        """Called when an agent's session ends: no new work goes to the node."""
        async with self._db.session() as session:
            node = await session.scalar(sa.select(NodeRow).where(NodeRow.name == node_name))
            if node is not None:
                node.state = scheduler_pb2.NodeState.NODE_STATE_NOT_READY

    async def list_nodes(self, page_size: int, offset: int) -> tuple[list[NodeRow], int]:
        async with self._db.session() as session:
            total = int(await session.scalar(sa.select(sa.func.count()).select_from(NodeRow)) or 0)
            rows = (
                await session.scalars(
                    sa.select(NodeRow).order_by(NodeRow.name).offset(offset).limit(page_size)
                )
            ).all()
        return list(rows), total

    # --- watches -----------------------------------------------------------------------------

    async def watch(self, team: str, job_ids: Iterable[str], send_initial: bool) -> AsyncIterator[JobRow]:
        """Yield matching jobs after every committed change; a watcher too slow to keep up is
        dropped with RESOURCE_EXHAUSTED rather than letting its queue grow without bound."""
        watcher = _Watcher(team=team, job_ids=frozenset(job_ids), queue=asyncio.Queue(self._watch_queue_size))
        self._watchers.append(watcher)
        try:
            if send_initial:
                query = sa.select(JobRow)
                if team:
                    query = query.where(JobRow.team == team)
                if watcher.job_ids:
                    query = query.where(JobRow.id.in_(watcher.job_ids))
                async with self._db.session() as session:
                    for job in (await session.scalars(query.order_by(JobRow.created_at))).all():
                        yield job
            while True:
                update = await watcher.queue.get()
                if update is None:
                    raise errors.OverloadedError("watch stream fell behind; reconnect with send_initial")
                yield update
        finally:
            self._watchers.remove(watcher)

    def _committed(self, job: JobRow) -> None:
        self._on_commit()
        for watcher in list(self._watchers):
            if not watcher.wants(job):
                continue
            try:
                watcher.queue.put_nowait(job)
            except asyncio.QueueFull:
                while not watcher.queue.empty():
                    watcher.queue.get_nowait()
                watcher.queue.put_nowait(None)

    async def _stage_transition(self, session: AsyncSession, job: JobRow, previous: int, reason: str) -> None:
        spec = scheduler_pb2.JobSpec.FromString(job.spec)
        event = events_pb2.JobStateChanged(
            job_id=job.id,
            team=job.team,
            name=job.name,
            previous_state=previous,  # type: ignore[arg-type]
            state=job.state,  # type: ignore[arg-type]
            reason=reason,
            node_names=list(job.assigned_nodes),
            labels=dict(spec.labels),
        )
        await stage_event(session, event, producer=self._producer, key=job.id)


def _validate_quota(path: str, quota: scheduler_pb2.Quota) -> None:
    if not quota.gpu_type:
        raise errors.ValidationError(f"{path}.gpu_type", "must not be empty")
    if quota.weight < 0:
        raise errors.ValidationError(f"{path}.weight", "must not be negative")


def _quota_row(team: str, quota: scheduler_pb2.Quota) -> QuotaRow:
    return QuotaRow(
        team=team,
        gpu_type=quota.gpu_type,
        guaranteed_gpus=quota.guaranteed_gpus,
        borrow_limit=quota.borrow_limit,
        weight=quota.weight or 1.0,
    )


async def _team_view(session: AsyncSession, name: str) -> TeamView:
    team = await session.get(TeamRow, name)
    if team is None:
        raise errors.NotFoundError(f"team {name!r} not found")
    quotas = (
        await session.scalars(sa.select(QuotaRow).where(QuotaRow.team == name).order_by(QuotaRow.gpu_type))
    ).all()
    return TeamView(
        name=team.name, display_name=team.display_name, created_at=team.created_at, quotas=tuple(quotas)
    )


async def _job(session: AsyncSession, job_id: str) -> JobRow:
    if not job_id:
        raise errors.ValidationError("job_id", "must not be empty")
    job = await session.get(JobRow, job_id)
    if job is None:
        raise errors.NotFoundError(f"job {job_id!r} not found")
    return job


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    rank = q * (len(sorted_values) - 1)
    low = int(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)
