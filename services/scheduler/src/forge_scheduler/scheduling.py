"""The scheduling loop: the live service's driver of the policy engine.

:meth:`SchedulingLoop.cycle` is one pass, in numbered steps:

1. expire lost nodes: a node silent for longer than ``node_lost_after_s`` is NOT_READY and every
   job placed on it goes back to the queue (replicas elsewhere are cancelled);
2. read a snapshot: ready nodes (GPUs still stopping from earlier placements are taken off),
   teams with quotas and cohorts, pending jobs, placed jobs as allocations;
3. advance each team's decayed usage to now and persist it (fair share survives a restart);
4. run :meth:`PolicyEngine.cycle` (pure; in a worker thread so the event loop keeps serving);
5. apply, in one transaction: each start takes concrete GPU indices on its nodes and moves the
   job to SCHEDULED; each preemption records its deadline; each pending job gets its reason
   and, for the reservation, an estimated start (jobs without GPUs are placed by the same cycle,
   on the least busy nodes);
6. after the commit, send StartJob / PreemptJob / CancelJob to the agents, publish the cluster
   figures (utilisation, fragmentation, fairness) to Prometheus and to ``GetClusterStats``.

Between cycles the loop sleeps ``interval_s`` or until something changed (a submit, a report,
a node registering).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import math
import time
from dataclasses import dataclass, field

import sqlalchemy as sa
import structlog
from prometheus_client import Gauge, Histogram
from sqlalchemy.orm.exc import StaleDataError

from forge_scheduler.commands import AgentCommand, CancelJob, PreemptJob, node_addresses, start_command
from forge_scheduler.gcpause import collector_paused
from forge_scheduler.nodes import holding_jobs, used_gpu_indices
from forge_scheduler.policy import (
    Allocation,
    CycleResult,
    PendingJob,
    PolicyConfig,
    PolicyEngine,
    Snapshot,
    Team,
)
from forge_scheduler.policy import metrics as policy_metrics
from forge_scheduler.policy_view import epoch, policy_job, policy_node
from forge_scheduler.records import ClusterView
from forge_scheduler.service import SchedulerService
from forge_scheduler.states import ACTIVE, CANCELLED, NODE_NOT_READY, NODE_READY, PENDING, SCHEDULED
from forge_scheduler.store import JobRow, NodeRow, QuotaRow, TeamRow, TeamUsageRow

log = structlog.get_logger(__name__)

CYCLE_SECONDS = Histogram(
    "forge_scheduler_cycle_seconds",
    "Duration of one scheduling cycle",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
QUEUE_TIME = Histogram(
    "forge_scheduler_queue_time_seconds",
    "Time from entering the queue to being scheduled",
    ["team"],
    buckets=(1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 12 * 3600, 86400),
)
PENDING_JOBS = Gauge("forge_scheduler_pending_jobs", "Jobs waiting", ["team"])
TEAM_GPUS = Gauge("forge_scheduler_team_gpus_allocated", "GPUs held by the team's jobs", ["team"])
TEAM_SHARE = Gauge("forge_scheduler_team_fair_share_gpus", "The team's weighted max-min fair share", ["team"])
UTILIZATION = Gauge("forge_scheduler_utilization", "Allocated / total GPUs on ready nodes")
FRAGMENTED = Gauge("forge_scheduler_fragmented_gpus", "Free GPUs no pending task can use")
JAIN = Gauge("forge_scheduler_jain_index", "Jain's index over allocation / fair share")
PREEMPTIONS = Gauge("forge_scheduler_preemptions_in_flight", "Preemptions ordered and not yet finished")

NodeSlots = list[list[object]]


@dataclass
class CycleReport:
    """What one cycle did (for tests and logs)."""

    started: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    requeued: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0


class SchedulingLoop:
    """Runs the policy against the service's database; one cycle at a time."""

    def __init__(
        self,
        service: SchedulerService,
        config: PolicyConfig | None = None,
        *,
        interval_s: float = 1.0,
        node_lost_after_s: float = 15.0,
        usage_half_life_s: float = 7 * 86400.0,
    ) -> None:
        self._service = service
        self._engine = PolicyEngine(config or PolicyConfig.forge())
        self._interval_s = interval_s
        self._node_lost_after_s = node_lost_after_s
        self._half_life_s = usage_half_life_s
        self._lock = asyncio.Lock()
        self._changed = asyncio.Event()
        service.on_change(self._changed.set)
        self._failed = False
        """A cycle failed (its database away, say) since the last one that ran."""
        self._expire_from: dt.datetime | None = None
        """No node is called lost before this: the heartbeats of a database outage went unrecorded."""

    def wake(self) -> None:
        self._changed.set()

    async def run(self) -> None:
        """Cycle forever; a failed cycle is logged and retried at the next tick."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=self._interval_s)
            self._changed.clear()
            try:
                await self.cycle()
            except asyncio.CancelledError:
                raise
            except StaleDataError:
                # A job row changed under the cycle (an agent's report): nothing was committed
                # or sent; the next cycle decides on the fresh rows, at once.
                log.info("scheduler.cycle_conflict")
                self._changed.set()
            except Exception:
                self._failed = True
                log.exception("scheduler.cycle_failed")

    async def cycle(self) -> CycleReport:
        async with self._lock:
            started = time.perf_counter()
            report = CycleReport()
            now = self._service.now()
            if self._failed:
                # While cycles failed, heartbeats could not be recorded either (they are writes to
                # the same database): the nodes' last_heartbeat_at is as old as the outage, not as
                # their silence. Each gets a full loss timeout, from now, to be heard from again;
                # requeueing at once would run a job twice whose node finished it meanwhile.
                self._failed = False
                self._expire_from = now + dt.timedelta(seconds=self._node_lost_after_s)
                log.warning("scheduler.recovered", nodes_judged_from=self._expire_from.isoformat())
            # 1. Lost nodes.
            if self._expire_from is None or now >= self._expire_from:
                await self._expire_lost_nodes(now, report)
            # 2.-3. Snapshot and usage.
            snap, rows = await self._snapshot(now)
            # 4. Policy.
            result = await asyncio.to_thread(self._decide, snap, epoch(now))
            # 5.-6. Apply and tell the agents.
            await self._apply(result, rows, now, report)
            report.seconds = time.perf_counter() - started
            self._publish(snap, result, rows, report.seconds, now)
            CYCLE_SECONDS.observe(report.seconds)
            if report.started or report.preempted or report.requeued:
                log.info(
                    "scheduler.cycle",
                    started=report.started,
                    preempted=report.preempted,
                    requeued=report.requeued,
                    ms=round(report.seconds * 1000, 2),
                )
            return report

    def _decide(self, snap: Snapshot, now: float) -> CycleResult:
        """The policy's cycle with the cyclic garbage collector paused (see ``gcpause``): a full
        collection of the service's heap would otherwise land inside one cycle in a few."""
        with collector_paused():
            return self._engine.cycle(snap, now)

    # --- 1. lost nodes -------------------------------------------------------------------------

    async def _expire_lost_nodes(self, now: dt.datetime, report: CycleReport) -> None:
        service = self._service
        cutoff = now - dt.timedelta(seconds=self._node_lost_after_s)
        cancels: list[tuple[str, str]] = []
        changed: list[JobRow] = []
        async with service.db.session() as session:
            nodes = (await session.scalars(sa.select(NodeRow))).all()
            lost = {n.name for n in nodes if n.last_heartbeat_at is None or n.last_heartbeat_at < cutoff}
            if not lost:
                return
            for row in nodes:
                if row.name in lost and row.state == NODE_READY:
                    row.state = NODE_NOT_READY
                    log.warning("scheduler.node_lost", node=row.name)
            for job in (await session.scalars(holding_jobs())).all():
                if job.draining:
                    job.draining = [s for s in job.draining if s[0] not in lost] or None
                placed = {str(node) for node, _ in job.slots or []}
                gone = sorted(placed & lost)
                if not gone or job.state not in ACTIVE:
                    continue
                previous = job.state
                # The replicas on the lost node are gone with it; the others are cancelled.
                job.replica_states = {**(job.replica_states or {}), **dict.fromkeys(gone, int(CANCELLED))}
                stopping = service.requeue(job, now, f"node {', '.join(gone)} lost; requeued")
                await service.stage_transition(session, job, previous, job.message)
                cancels += [(node, job.id) for node in stopping]
                changed.append(job)
                report.requeued.append(job.id)
        for job in changed:
            service.committed(job)
        for node, job_id in cancels:
            service.hub.send(node, CancelJob(job_id, "a node of the job was lost"))

    # --- 2. snapshot ---------------------------------------------------------------------------

    async def _snapshot(self, now: dt.datetime) -> tuple[Snapshot, _Rows]:
        service = self._service
        async with service.db.session() as session:
            node_rows = (
                await session.scalars(
                    sa.select(NodeRow).where(NodeRow.state == NODE_READY).order_by(NodeRow.name)
                )
            ).all()
            team_rows = (await session.scalars(sa.select(TeamRow))).all()
            quota_rows = (await session.scalars(sa.select(QuotaRow))).all()
            held = (await session.scalars(holding_jobs())).all()
            pending_rows = (
                await session.scalars(
                    sa.select(JobRow).where(JobRow.state == PENDING).order_by(JobRow.created_at)
                )
            ).all()
            usage_rows = {u.team: u for u in (await session.scalars(sa.select(TeamUsageRow))).all()}
            # 3. Decayed usage, advanced to now with what each team holds.
            holding_by_team: dict[str, int] = {}
            for job in held:
                if job.state in ACTIVE:
                    holding_by_team[job.team] = (
                        holding_by_team.get(job.team, 0) + job.gpus_per_replica * job.replicas
                    )
            usage: dict[str, float] = {}
            for team in team_rows:
                row = usage_rows.get(team.name)
                elapsed = max(0.0, (now - row.updated_at).total_seconds()) if row else 0.0
                value = decayed_usage(
                    row.decayed_gpu_s if row else 0.0,
                    holding_by_team.get(team.name, 0),
                    elapsed,
                    self._half_life_s,
                )
                usage[team.name] = value
                if row is None:
                    session.add(TeamUsageRow(team=team.name, decayed_gpu_s=value, updated_at=now))
                else:
                    row.decayed_gpu_s, row.updated_at = value, now
        used = used_gpu_indices(held)
        draining: dict[str, int] = {}
        for job in held:
            for node, gpus in job.draining or []:
                draining[str(node)] = draining.get(str(node), 0) + len(gpus)
        nodes = []
        for node_row in node_rows:
            node = policy_node(node_row)
            if draining.get(node_row.name):
                node = dataclasses.replace(node, gpus=max(0, node.gpus - draining[node_row.name]))
            if node.gpus > 0:
                nodes.append(node)
        quotas: dict[str, list[QuotaRow]] = {}
        for quota in quota_rows:
            quotas.setdefault(quota.team, []).append(quota)
        teams = {
            t.name: Team(
                name=t.name,
                guaranteed={q.gpu_type: q.guaranteed_gpus for q in quotas.get(t.name, [])},
                borrow_limit=sum(q.borrow_limit for q in quotas.get(t.name, [])),
                weight=max((q.weight for q in quotas.get(t.name, [])), default=1.0) or 1.0,
                cohort=t.cohort,
            )
            for t in team_rows
        }
        ready = {n.name for n in nodes}
        running = []
        for job in held:
            if job.state not in ACTIVE or not job.slots:
                continue
            slots = tuple(
                (str(node), job.gpus_per_replica) for node in job.assigned_nodes if str(node) in ready
            )
            if len(slots) != job.replicas:
                continue
            running.append(
                Allocation(
                    job=policy_job(job),
                    slots=slots,
                    start_time=epoch(job.started_at or job.queued_at or job.created_at),
                    last_checkpoint_time=epoch(job.last_checkpoint_at) if job.last_checkpoint_at else None,
                    attained_gpu_s=job.attained_gpu_s,
                    borrowed=job.borrowed,
                    preempting=job.preempt_by is not None,
                    checkpoint_interval_s=job.checkpoint_interval_s or None,
                )
            )
        pending = [
            PendingJob(
                job=policy_job(job),
                attained_gpu_s=job.attained_gpu_s,
                queued_since=epoch(job.queued_at) if job.queued_at else None,
            )
            for job in pending_rows
        ]
        snap = Snapshot(nodes=nodes, teams=teams, pending=pending, running=running, usage=usage)
        return snap, _Rows(
            nodes={n.name: n for n in node_rows if n.name in ready},
            pending={j.id: j for j in pending_rows},
            used=used,
        )

    # --- 5. apply ------------------------------------------------------------------------------

    async def _apply(self, result: CycleResult, rows: _Rows, now: dt.datetime, report: CycleReport) -> None:
        service = self._service
        commands: list[tuple[str, AgentCommand]] = []
        changed: list[JobRow] = []
        starts = {s.job_id: s for s in result.starts}
        victims = {p.job_id: p for p in result.preemptions}
        async with service.db.session() as session:
            held = (await session.scalars(holding_jobs())).all()
            used = used_gpu_indices(held)
            addresses = await node_addresses(session)
            for job_id, start in starts.items():
                job = await session.get(JobRow, job_id)
                if job is None or job.state != PENDING:
                    continue  # cancelled since the snapshot
                slots = _take_gpus(start.slots, rows.nodes, used)
                if slots is None:
                    continue  # GPUs taken since the snapshot; the next cycle sees it
                self._start(job, slots, [node for node, _ in start.slots], start.borrowed)
                await service.stage_transition(session, job, PENDING, job.message)
                commands += [
                    (str(node), start_command(job, str(node), addresses.get(str(slots[0][0]), "127.0.0.1")))
                    for node, _ in slots
                ]
                changed.append(job)
                report.started.append(job.id)
            for job_id, preemption in victims.items():
                job = await session.get(JobRow, job_id)
                if job is None or job.state not in ACTIVE or job.preempt_by is not None:
                    continue
                job.preempt_by = dt.datetime.fromtimestamp(preemption.stop_by, dt.UTC).replace(tzinfo=None)
                job.message = f"preempting: {preemption.reason}"
                grace = max(0, round(preemption.stop_by - epoch(now)))
                for node in sorted({str(n) for n, _ in job.slots or []}):
                    commands.append((node, PreemptJob(job.id, preemption.reason, grace)))
                report.preempted.append(job.id)
            reservation = result.reservation
            for job_id, reason in result.reasons.items():
                job = rows.pending.get(job_id)
                if job is None or job_id in starts:
                    continue
                fresh = await session.get(JobRow, job_id)
                if fresh is None or fresh.state != PENDING:
                    continue
                estimate = None
                if reservation is not None and reservation.job_id == job_id and reservation.estimated_start:
                    estimate = dt.datetime.fromtimestamp(reservation.estimated_start, dt.UTC).replace(
                        tzinfo=None
                    )
                if fresh.pending_reason != reason or fresh.estimated_start != estimate:
                    fresh.pending_reason, fresh.estimated_start = reason, estimate
                report.reasons[job_id] = reason
        for job in changed:
            service.committed(job)
            queued = job.queued_at or job.created_at
            QUEUE_TIME.labels(job.team).observe(max(0.0, (now - queued).total_seconds()))
        for node, command in commands:
            service.hub.send(node, command)
        positions: dict[str, int] = {}
        per_team: dict[str, int] = {}
        for job_id in result.order:
            job = rows.pending.get(job_id)
            if job is None or job_id in starts:
                continue
            per_team[job.team] = per_team.get(job.team, 0) + 1
            positions[job_id] = per_team[job.team]
        service.cluster.queue_positions = positions

    @staticmethod
    def _start(job: JobRow, slots: NodeSlots, assigned: list[str], borrowed: bool) -> None:
        """``slots``: GPU indices per node (one StartJob each); ``assigned``: node per replica."""
        job.state = SCHEDULED
        job.attempt += 1
        job.slots = slots
        job.assigned_nodes = list(assigned)
        job.replica_states = {str(node): int(SCHEDULED) for node, _ in slots}
        job.borrowed = borrowed
        job.preempt_by = None
        job.pending_reason = ""
        job.estimated_start = None
        job.message = f"scheduled on {', '.join(sorted({str(n) for n, _ in slots}))} (attempt {job.attempt})"

    # --- 6. figures ----------------------------------------------------------------------------

    def _publish(
        self, snap: Snapshot, result: CycleResult, rows: _Rows, seconds: float, now: dt.datetime
    ) -> None:
        total = sum(n.gpus for n in snap.nodes)
        # jobs without GPUs hold none: the figures are about GPUs
        starts = {s.job_id for s in result.starts}
        started = {s.job_id: s for s in result.starts if any(gpus for _, gpus in s.slots)}
        running = [a for a in snap.running if a.job.gpus]
        allocation: dict[str, float] = {}
        free = {n.name: n.gpus for n in snap.nodes}
        for alloc in running:
            allocation[alloc.job.team] = allocation.get(alloc.job.team, 0) + alloc.job.gpus
            for node, gpus in alloc.slots:
                free[node] = free.get(node, 0) - gpus
        for start in started.values():
            job = rows.pending.get(start.job_id)
            if job is None:
                continue
            allocation[job.team] = allocation.get(job.team, 0) + job.gpus_per_replica * job.replicas
            for node, gpus in start.slots:
                free[node] = free.get(node, 0) - gpus
        waiting = [p for p in snap.pending if p.job.gpus and p.job.id not in started]
        demand = dict(allocation)
        for p in waiting:
            demand[p.job.team] = demand.get(p.job.team, 0) + p.job.gpus
        weights = {name: team.weight for name, team in snap.teams.items()}
        jain, deviation = policy_metrics.fairness(total, allocation, demand, weights)
        shares = policy_metrics.fair_shares(total, demand, weights)
        fragmented = policy_metrics.fragmented_gpus(free, [p.job.gpus_per_task for p in waiting])
        group_free: dict[str, int] = {}
        for ready in snap.nodes:
            group_free[ready.group] = group_free.get(ready.group, 0) + max(0, free.get(ready.name, 0))
        allocated = int(sum(allocation.values()))
        self._service.cluster = ClusterView(
            total_gpus=total,
            allocated_gpus=allocated,
            utilization=policy_metrics.utilisation(allocated, total),
            fragmented_gpus=fragmented,
            jain_index=jain,
            share_deviation_gpus=deviation,
            ready_nodes=len(snap.nodes),
            pending_jobs=sum(1 for j in rows.pending.values() if j.id not in starts),
            running_jobs=len(running) + len(started),
            largest_free_block=max(group_free.values(), default=0),
            last_cycle_ms=seconds * 1000,
            last_cycle_at=now,
            fair_shares=shares,
            queue_positions=self._service.cluster.queue_positions,
        )
        UTILIZATION.set(self._service.cluster.utilization)
        FRAGMENTED.set(fragmented)
        JAIN.set(jain)
        PREEMPTIONS.set(sum(1 for a in running if a.preempting) + len(result.preemptions))
        pending_by_team: dict[str, int] = {}
        for job in rows.pending.values():
            if job.id not in started:
                pending_by_team[job.team] = pending_by_team.get(job.team, 0) + 1
        for team in snap.teams:
            PENDING_JOBS.labels(team).set(pending_by_team.get(team, 0))
            TEAM_GPUS.labels(team).set(allocation.get(team, 0))
            TEAM_SHARE.labels(team).set(shares.get(team, 0.0))


@dataclass
class _Rows:
    nodes: dict[str, NodeRow]
    pending: dict[str, JobRow]
    used: dict[str, set[int]]


def decayed_usage(previous_gpu_s: float, held_gpus: int, elapsed_s: float, half_life_s: float) -> float:
    """Slurm-style decayed usage after ``elapsed_s`` holding ``held_gpus`` (the closed form of
    :class:`~forge_scheduler.policy.UsageLedger`): u·e^(-λt) + g·(1 - e^(-λt))/λ, λ = ln 2 / half-life."""
    if elapsed_s <= 0:
        return previous_gpu_s
    rate = math.log(2) / half_life_s
    decay = math.exp(-rate * elapsed_s)
    return previous_gpu_s * decay + held_gpus * (1.0 - decay) / rate


def _take_gpus(
    slots: tuple[tuple[str, int], ...], nodes: dict[str, NodeRow], used: dict[str, set[int]]
) -> NodeSlots | None:
    """Concrete GPU indices for a start, grouped by node in first-appearance order (rank order);
    None when a node no longer has enough free GPUs. Marks the taken indices in ``used``."""
    want: dict[str, int] = {}
    for name, count in slots:
        want[name] = want.get(name, 0) + count
    chosen: list[tuple[str, list[int]]] = []
    for node, count in want.items():
        row = nodes.get(node)
        if row is None:
            return None
        free = [int(g["index"]) for g in row.gpus if int(g["index"]) not in used.get(node, set())]
        if len(free) < count:
            return None
        chosen.append((node, sorted(free)[:count]))
    for node, gpus in chosen:
        used.setdefault(node, set()).update(gpus)
    return [[node, gpus] for node, gpus in chosen]
