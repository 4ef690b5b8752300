"""Scheduler domain logic: teams, quotas and tokens, the job lifecycle, nodes, job watches.

Every state change of a job is written together with its ``JobStateChanged`` event in one
transaction (the outbox), then broadcast to in-process watchers once committed; commands for
agents (start, preempt, cancel) are sent through the :class:`~forge_scheduler.hub.AgentHub` only
after that commit. Placement and preemption decisions come from the scheduling loop
(:mod:`forge_scheduler.scheduling`), which applies the policy engine's cycle through this class.

A job's replicas are grouped by node: one StartJob per node, with all of the job's GPU indices
on that node (torchrun runs one worker per GPU). ``replica_states`` tracks each node's last
report; the job succeeds when every node succeeded, fails when one fails, and returns to the
queue when its replicas were preempted or its node was lost.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import re
import secrets
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

import sqlalchemy as sa
import structlog
from forge.common.v1 import common_pb2
from forge.events.v1 import events_pb2
from forge.scheduler.v1 import scheduler_pb2
from google.protobuf import json_format
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm.exc import StaleDataError

from forge_kit import errors
from forge_kit.db import Database
from forge_kit.events import stage_event
from forge_kit.grpckit import Principal, current_principal, require_admin
from forge_kit.stats import percentile
from forge_kit.validate import check_finite, check_labels
from forge_scheduler.hub import AgentHub
from forge_scheduler.policy import Job, Node, Placement, Priority, never_fits
from forge_scheduler.store import JobRow, NodeRow, QuotaRow, TeamRow, TeamTokenRow, TeamUsageRow, utcnow

JobState = common_pb2.JobState
PENDING, SCHEDULED, RUNNING = (
    JobState.JOB_STATE_PENDING,
    JobState.JOB_STATE_SCHEDULED,
    JobState.JOB_STATE_RUNNING,
)
SUCCEEDED, FAILED, CANCELLED, PREEMPTED = (
    JobState.JOB_STATE_SUCCEEDED,
    JobState.JOB_STATE_FAILED,
    JobState.JOB_STATE_CANCELLED,
    JobState.JOB_STATE_PREEMPTED,
)
TERMINAL = frozenset({SUCCEEDED, FAILED, CANCELLED})
ACTIVE = frozenset({SCHEDULED, RUNNING})
#: States a replica reports when its process has ended.
REPLICA_ENDED = frozenset({SUCCEEDED, FAILED, CANCELLED, PREEMPTED})
MAX_DURATION_S = 90 * 86400
INFERENCE_POOL_LABEL = "forge.ai/inference-pool"
#: Kinds that are gangs of GPU tasks; other kinds (unspecified, eval, interactive) may be CPU-only.
GPU_KINDS = frozenset(
    {scheduler_pb2.JOB_KIND_TRAINING, scheduler_pb2.JOB_KIND_FINE_TUNE, scheduler_pb2.JOB_KIND_INFERENCE}
)
_PLACEMENTS = {
    scheduler_pb2.PLACEMENT_ANY: Placement.ANY,
    scheduler_pb2.PLACEMENT_SAME_NODE: Placement.SAME_NODE,
    scheduler_pb2.PLACEMENT_SAME_NODE_GROUP: Placement.SAME_GROUP,
}
PRIORITY_CLASSES = ("production", "high", "normal", "preemptible")
_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


@dataclass(frozen=True)
class TeamView:
    """A team with its quotas, as returned to callers."""

    name: str
    display_name: str
    created_at: dt.datetime
    quotas: tuple[QuotaRow, ...]

    cohort: str = "default"


@dataclass(frozen=True)
class QueueStats:
    """Queue figures of one team."""

    team: str
    pending_jobs: int = 0
    running_jobs: int = 0
    gpus_in_use: int = 0
    queue_time_p50_s: float = 0.0
    queue_time_p95_s: float = 0.0
    guaranteed_gpus: int = 0
    borrowed_gpus: int = 0
    fair_share_gpus: float = 0.0
    share_ratio: float = 0.0
    decayed_usage_gpu_hours: float = 0.0


@dataclass
class ClusterView:
    """Figures of the last scheduling cycle (kept in memory; recomputed every cycle)."""

    total_gpus: int = 0
    allocated_gpus: int = 0
    utilization: float = 0.0
    fragmented_gpus: int = 0
    jain_index: float = 1.0
    share_deviation_gpus: float = 0.0
    ready_nodes: int = 0
    pending_jobs: int = 0
    running_jobs: int = 0
    largest_free_block: int = 0
    last_cycle_ms: float = 0.0
    last_cycle_at: dt.datetime | None = None
    fair_shares: dict[str, float] = field(default_factory=dict)
    queue_positions: dict[str, int] = field(default_factory=dict)


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
    if spec.placement not in (*_PLACEMENTS, scheduler_pb2.PLACEMENT_UNSPECIFIED):
        raise errors.ValidationError("spec.placement", f"unknown placement {spec.placement}")
    for name in ("max_runtime_seconds", "min_runtime_seconds", "checkpoint_interval_seconds"):
        if getattr(spec, name) > MAX_DURATION_S:
            raise errors.ValidationError(f"spec.{name}", f"must be at most {MAX_DURATION_S} (90 days)")
    if spec.max_runtime_seconds and spec.min_runtime_seconds > spec.max_runtime_seconds:
        raise errors.ValidationError("spec.min_runtime_seconds", "must not exceed max_runtime_seconds")
    if spec.priority_class not in PRIORITY_CLASSES:
        raise errors.ValidationError("spec.priority_class", f"must be one of {', '.join(PRIORITY_CLASSES)}")
    if spec.resources.gpu_count == 0 and spec.kind in GPU_KINDS:
        kind = scheduler_pb2.JobKind.Name(spec.kind).removeprefix("JOB_KIND_").lower()
        raise errors.ValidationError("spec.resources.gpu_count", f"must be at least 1 for a {kind} job")
    if spec.resources.gpu_count > 0 and not spec.resources.gpu_type:
        raise errors.ValidationError("spec.resources.gpu_type", "is required when gpu_count > 0")
    if spec.resources.gpu_count > 64:
        raise errors.ValidationError("spec.resources.gpu_count", "must be at most 64 per replica")
    if spec.replicas > 1024:
        raise errors.ValidationError("spec.replicas", "must be at most 1024")
    if not spec.command:
        raise errors.ValidationError("spec.command", "must not be empty")
    check_labels("spec.labels", spec.labels)


def placement_of(spec: scheduler_pb2.JobSpec) -> Placement:
    if spec.placement != scheduler_pb2.PLACEMENT_UNSPECIFIED:
        return _PLACEMENTS[spec.placement]
    return Placement.SAME_GROUP if spec.same_node_group else Placement.ANY


def epoch(value: dt.datetime) -> float:
    """Seconds since the epoch of a naive UTC datetime (the policy's clock)."""
    return value.replace(tzinfo=dt.UTC).timestamp()


def policy_job(job: JobRow) -> Job:
    """The policy's view of a job record."""
    spec = scheduler_pb2.JobSpec.FromString(job.spec)
    return Job(
        id=job.id,
        team=job.team,
        tasks=job.replicas,
        gpus_per_task=job.gpus_per_replica,
        gpu_type=job.gpu_type,
        priority=Priority.parse(job.priority_class),
        placement=Placement(job.placement),
        submit_time=epoch(job.created_at),
        min_runtime_s=job.min_runtime_s,
        checkpointable=job.checkpointable,
        time_limit_s=float(spec.max_runtime_seconds) or None,
        workload=scheduler_pb2.JobKind.Name(spec.kind).removeprefix("JOB_KIND_").lower(),
    )


def policy_node(node: NodeRow) -> Node:
    """The policy's view of a node: its GPUs are taken to be of the first GPU's type."""
    gpu_type = str(node.gpus[0]["type"]) if node.gpus else ""
    return Node(
        name=node.name,
        gpus=len(node.gpus),
        gpu_type=gpu_type,
        group=node.node_group or node.name,
        rack=node.rack,
        inference_pool=node.labels.get(INFERENCE_POOL_LABEL, "").lower() == "true",
    )


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


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def authorize_team(team: str, action: str) -> None:
    """A team token may act only for its own team; admins (the service token) for any."""
    principal = current_principal()
    if principal is not None and not principal.is_admin and principal.team != team:
        raise errors.PermissionDeniedError(f"{principal.name} may not {action} jobs of team {team!r}")


def _by_admin() -> bool:
    """Whether the caller is an admin (a service token), or no authentication is in force."""
    principal = current_principal()
    return principal is None or principal.is_admin


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
        hub: AgentHub | None = None,
    ) -> None:
        self._db = db
        self._producer = producer
        self._clock = clock
        self._on_commit = on_commit
        self._watch_queue_size = watch_queue_size
        self._watchers: list[_Watcher] = []
        self.hub = hub or AgentHub()
        self.cluster = ClusterView()
        self._team_tokens: dict[str, str] = {}
        self._wake: Callable[[], None] = lambda: None

    @property
    def db(self) -> Database:
        return self._db

    def now(self) -> dt.datetime:
        return self._clock()

    def on_change(self, wake: Callable[[], None]) -> None:
        """``wake`` is called after every change that may let a job start (the scheduling loop)."""
        self._wake = wake

    # --- team tokens -------------------------------------------------------------------------

    async def load_tokens(self) -> None:
        async with self._db.session() as session:
            rows = (await session.scalars(sa.select(TeamTokenRow))).all()
        self._team_tokens = {row.token_hash: row.team for row in rows}

    def authenticate(self, token: str) -> Principal | None:
        """The kit's authenticator hook: a known team token acts for its team only."""
        team = self._team_tokens.get(token_hash(token))
        return None if team is None else Principal(name=f"team:{team}", role="team", team=team)

    async def issue_team_token(self, team: str, description: str) -> tuple[str, str]:
        """(token, token id). Only the hash is stored; the token is returned this once."""
        require_admin("IssueTeamToken")
        validate_name("team", team)
        if len(description) > 255:
            raise errors.ValidationError("description", "must be at most 255 characters")
        token = f"forge-team-{team}-{secrets.token_urlsafe(24)}"
        digest = token_hash(token)
        async with self._db.session() as session:
            if await session.get(TeamRow, team) is None:
                raise errors.NotFoundError(f"team {team!r} not found")
            session.add(
                TeamTokenRow(token_hash=digest, team=team, description=description, created_at=self._clock())
            )
        self._team_tokens[digest] = team
        return token, digest[:12]

    # --- teams -------------------------------------------------------------------------------

    async def create_team(
        self, name: str, display_name: str, quotas: Iterable[scheduler_pb2.Quota], cohort: str = ""
    ) -> TeamView:
        require_admin("CreateTeam")
        validate_name("name", name)
        if cohort:
            validate_name("cohort", cohort)
        quotas = list(quotas)
        for i, quota in enumerate(quotas):
            _validate_quota(f"quotas[{i}]", quota)
        async with self._db.session() as session:
            if await session.get(TeamRow, name) is not None:
                raise errors.AlreadyExistsError(f"team {name!r} already exists")
            session.add(
                TeamRow(
                    name=name,
                    display_name=display_name or name,
                    created_at=self._clock(),
                    cohort=cohort or "default",
                )
            )
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
        require_admin("SetQuota")
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
        self._wake()
        return await self.get_team(team)

    # --- jobs --------------------------------------------------------------------------------

    async def submit_job(
        self, spec: scheduler_pb2.JobSpec, request_id: str = "", *, on_behalf_of: str = ""
    ) -> JobRow:
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
                gpu_type=spec.resources.gpu_type,
                gpus_per_replica=spec.resources.gpu_count,
                replicas=max(1, spec.replicas),
                spec=spec.SerializeToString(),
                state=PENDING,
                message="queued",
                assigned_nodes=[],
                preemption_count=0,
                created_at=now,
                queued_at=now,
                placement=placement_of(spec).value,
                min_runtime_s=float(spec.min_runtime_seconds),
                checkpointable=spec.checkpointable,
                checkpoint_interval_s=float(spec.checkpoint_interval_seconds),
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
            await self.stage_transition(session, job, JobState.JOB_STATE_UNSPECIFIED, "submitted")
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
        """Cancel a job; idempotent for jobs already finished. Running replicas are told to stop;
        their GPUs stay taken until each agent reports the replica ended."""
        return await retry_on_conflict(lambda: self._cancel_job(job_id, reason), "cancel_job")

    async def _cancel_job(self, job_id: str, reason: str) -> JobRow:
        async with self._db.session() as session:
            job = await _job(session, job_id)
            authorize_team(job.team, "cancel")
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
            self.hub.send(
                node,
                scheduler_pb2.AgentSessionResponse(
                    cancel_job=scheduler_pb2.CancelJob(job_id=job.id, reason=job.message)
                ),
            )
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
        job.preempt_by = None
        return sorted({node for node, _ in live})

    async def update_job_status(self, node_name: str, update: scheduler_pb2.JobStatusUpdate) -> JobRow | None:
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

    async def _update_job_status(
        self, node_name: str, update: scheduler_pb2.JobStatusUpdate
    ) -> JobRow | None:
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
            if update.HasField("last_checkpoint_at"):
                job.last_checkpoint_at = update.last_checkpoint_at.ToDatetime()
            states = dict(job.replica_states or {})
            states[node_name] = int(update.state)
            job.replica_states = states
            previous = job.state
            detail = update.message or f"reported by {node_name}"
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
            self.hub.send(
                node,
                scheduler_pb2.AgentSessionResponse(
                    cancel_job=scheduler_pb2.CancelJob(job_id=update.job_id, reason="another replica failed")
                ),
            )
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
            node.gpus = [
                {
                    "index": g.index,
                    "type": g.type,
                    "memory_mb": g.memory_mb,
                    "uuid": g.uuid,
                    "pci_bus_id": g.pci_bus_id,
                    "nvlink_group": g.nvlink_group,
                    "pcie_group": g.pcie_group,
                }
                for g in request.gpus
            ]
            node.node_group = request.topology.node_group
            node.rack = request.topology.rack
            node.nvlink_domain = request.topology.nvlink_domain
            node.labels = dict(request.labels)
            node.state = scheduler_pb2.NodeState.NODE_STATE_READY
            node.last_heartbeat_at = self._clock()
            node.running_job_ids = list(request.running_job_ids)
            node.job_isolation = (
                json_format.MessageToDict(request.job_isolation)
                if request.HasField("job_isolation")
                else None
            )
        self._wake()
        return node

    async def outstanding_starts(
        self, node_name: str, running: Iterable[str]
    ) -> list[scheduler_pb2.AgentSessionResponse]:
        """StartJob commands for jobs placed on the node that its agent does not run: sent
        again when an agent (re)registers, since a command sent while it was away was lost."""
        running = set(running)
        async with self._db.session() as session:
            jobs = (await session.scalars(sa.select(JobRow).where(JobRow.state == SCHEDULED))).all()
            addresses = await node_addresses(session)
            return [
                start_command(job, node_name, addresses.get((job.slots or [[""]])[0][0], "127.0.0.1"))
                for job in jobs
                if job.id not in running and any(node == node_name for node, _ in (job.slots or []))
            ]

    async def heartbeat(self, node_name: str, running_job_ids: Iterable[str]) -> None:
        async with self._db.session() as session:
            node = await session.scalar(sa.select(NodeRow).where(NodeRow.name == node_name))
            if node is None:
                raise errors.NotFoundError(f"node {node_name!r} is not registered")
            node.last_heartbeat_at = self._clock()
            node.state = scheduler_pb2.NodeState.NODE_STATE_READY
            node.running_job_ids = list(running_job_ids)

    async def mark_node_lost(self, node_name: str) -> None:
        """Called when an agent's session ends: no new work goes to the node. Its jobs keep their
        GPUs until the node misses heartbeats for the loss timeout (the scheduling loop then
        requeues them), so an agent that reconnects quickly loses nothing."""
        async with self._db.session() as session:
            node = await session.scalar(sa.select(NodeRow).where(NodeRow.name == node_name))
            if node is not None:
                node.state = scheduler_pb2.NodeState.NODE_STATE_NOT_READY

    async def used_gpus(self) -> dict[str, set[int]]:
        """GPU indices taken on each node (placed and draining replicas)."""
        async with self._db.session() as session:
            return used_gpu_indices((await session.scalars(holding_jobs())).all())

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

    def committed(self, job: JobRow) -> None:
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

    async def stage_transition(self, session: AsyncSession, job: JobRow, previous: int, reason: str) -> None:
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


def holding_jobs() -> sa.Select[JobRow]:
    """Jobs that hold GPUs: placed (slots) or with replicas still stopping (draining)."""
    return sa.select(JobRow).where(sa.or_(JobRow.slots.is_not(None), JobRow.draining.is_not(None)))


def used_gpu_indices(jobs: Iterable[JobRow]) -> dict[str, set[int]]:
    used: dict[str, set[int]] = {}
    for job in jobs:
        for node, gpus in [*(job.slots or []), *(job.draining or [])]:
            used.setdefault(node, set()).update(int(g) for g in gpus)
    return used


ADDRESS_LABEL = "forge.ai/address"


def start_command(
    job: JobRow, node_name: str, master_addr: str = "127.0.0.1"
) -> scheduler_pb2.AgentSessionResponse:
    """The StartJob for the job's replica on ``node_name`` (rank = the node's position in
    ``slots``); ``master_addr`` is the rank-0 node's address (its ``forge.ai/address`` label)."""
    from forge_scheduler.api import job_to_proto  # translation lives in the API module

    nodes = [node for node, _ in job.slots or []]
    gpus = next(g for node, g in job.slots or [] if node == node_name)
    return scheduler_pb2.AgentSessionResponse(
        start_job=scheduler_pb2.StartJob(
            job=job_to_proto(job),
            gpu_indices=[int(g) for g in gpus],
            node_rank=nodes.index(node_name),
            num_nodes=len(nodes),
            master_addr=master_addr,
            master_port=master_port(job),
            attempt=job.attempt,
            submitted_by_admin=job.submitted_by_admin,
        )
    )


async def node_addresses(session: AsyncSession) -> dict[str, str]:
    """Node name → the address its agent announced (label ``forge.ai/address``), where set."""
    rows = (await session.scalars(sa.select(NodeRow))).all()
    return {n.name: n.labels[ADDRESS_LABEL] for n in rows if n.labels.get(ADDRESS_LABEL)}


def master_port(job: JobRow) -> int:
    """A rendezvous port for the attempt, spread over 29500-30499 by job id and attempt."""
    digest = hashlib.sha256(f"{job.id}/{job.attempt}".encode()).digest()
    return 29500 + int.from_bytes(digest[:2], "big") % 1000


#: Largest fair-share weight: far beyond any real ratio, and finite (NaN or infinity would
#: make every share comparison false).
MAX_QUOTA_WEIGHT = 1e6


def _validate_quota(path: str, quota: scheduler_pb2.Quota) -> None:
    if not quota.gpu_type:
        raise errors.ValidationError(f"{path}.gpu_type", "must not be empty")
    check_finite(f"{path}.weight", quota.weight, low=0, high=MAX_QUOTA_WEIGHT)


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
        name=team.name,
        display_name=team.display_name,
        created_at=team.created_at,
        quotas=tuple(quotas),
        cohort=team.cohort,
    )


async def _job(session: AsyncSession, job_id: str) -> JobRow:
    if not job_id:
        raise errors.ValidationError("job_id", "must not be empty")
    job = await session.get(JobRow, job_id)
    if job is None:
        raise errors.NotFoundError(f"job {job_id!r} not found")
    return job
