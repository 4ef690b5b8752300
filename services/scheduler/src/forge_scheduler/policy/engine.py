"""The scheduling cycle, one function per phase over a typed :class:`~.context.CycleContext`.

``PolicyEngine.cycle(snapshot, now)`` is pure: it reads a snapshot and returns decisions. The
service applies them to its database and agents; the simulator applies them to its event queue.
Baselines (strict FIFO, FIFO + backfill, Slurm-like multifactor) are configurations of the same
engine, so every policy is measured with the same placement code. The phases, after Kueue's
scheduler (nominate → order → per entry: admit, place, preempt, reserve):

- :func:`nominate` builds the context: the free-GPU index (inference-pool nodes in their own),
  GPUs held per team and type, the quota book;
- :func:`~.order.order` sorts the pending jobs;
- per entry, :func:`admit` (quota, borrowing inside the cohort), :func:`place` (best-fit gang
  placement within its topology constraint, then :func:`~.reservation.backfill` into the
  reservation), :func:`~.preemption.preempt`, :func:`~.reservation.reserve`;
- :func:`place_without_gpus` puts jobs that need no GPU on the least busy nodes, through the same
  entries and admission.
"""

from __future__ import annotations

from forge_scheduler.policy.capacity import CapacityIndex, Slots
from forge_scheduler.policy.config import Ordering, PolicyConfig
from forge_scheduler.policy.context import WHERE, CycleContext
from forge_scheduler.policy.decisions import (
    CycleResult,
    Entry,
    EntryStatus,
    Preemption,
    Reservation,
    Start,
)
from forge_scheduler.policy.model import Job, Node, PendingJob, Priority, Snapshot
from forge_scheduler.policy.order import order, tier
from forge_scheduler.policy.preemption import preempt
from forge_scheduler.policy.quota import QuotaBook
from forge_scheduler.policy.reservation import backfill, reserve

__all__ = [
    "CycleResult",
    "Ordering",
    "PolicyConfig",
    "PolicyEngine",
    "Preemption",
    "Reservation",
    "Start",
    "admit",
    "never_fits",
    "nominate",
    "place",
    "place_without_gpus",
]


class PolicyEngine:
    """Runs one scheduling cycle over a snapshot. Stateless between cycles; the clock is ``now``."""

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()

    def tier(self, attained_gpu_s: float) -> int:
        """Attained-service tier: 0 for a job that has used less than the first threshold."""
        return tier(self.config, attained_gpu_s)

    def cycle(self, snap: Snapshot, now: float) -> CycleResult:
        """One cycle: nominate, order, then admit / place / preempt / reserve each entry in order
        until nothing more can start; the rest get their reasons; jobs without GPUs last."""
        cfg = self.config
        ctx = nominate(cfg, snap, now)
        # gpus_per_task, not the gpus property: this runs over every pending job every cycle
        without = [p for p in snap.pending if not p.job.gpus_per_task]
        with_gpus = [p for p in snap.pending if p.job.gpus_per_task] if without else snap.pending
        for p in without:
            place_without_gpus(ctx, Entry(p, -1))
        preemptable = cfg.preemption and bool(snap.running)
        if not cfg.explain and ctx.general.total_free == 0 and ctx.pool.total_free == 0 and not preemptable:
            return ctx.result
        ordered, ctx.result.order = order(cfg, snap, with_gpus, now, ctx.capacity, ctx.held)
        for rank, p in enumerate(ordered):
            if ctx.exhausted():
                if cfg.explain:
                    explain_rest(ctx, ordered[rank:])
                break
            entry = Entry(p, rank)
            if ctx.blocked_at is not None:
                if not cfg.explain:
                    break  # nothing behind the blocked head may start
                entry.status = EntryStatus.BLOCKED
                ctx.note(entry, f"behind {rank - ctx.blocked_at} earlier jobs (strict FIFO)")
                continue
            if admit(ctx, entry) and not place(ctx, entry) and not preempt(ctx, entry):
                reserve(ctx, entry)
        return ctx.result


def nominate(config: PolicyConfig, snap: Snapshot, now: float) -> CycleContext:
    """Build the cycle's context: the free-GPU index from the nodes minus running allocations
    (inference-pool nodes in their own index), GPUs held per team and type, the quota book."""
    nodes = {n.name: n for n in snap.nodes}
    used: dict[str, int] = {}
    held: dict[tuple[str, str], int] = {}
    busy: dict[str, int] = {}
    for a in snap.running:
        team_name = a.job.team
        for name in {name for name, _ in a.slots}:
            busy[name] = busy.get(name, 0) + 1
        for name, gpus in a.slots:
            if not gpus:
                continue
            used[name] = used.get(name, 0) + gpus
            key = (team_name, nodes[name].gpu_type)
            held[key] = held.get(key, 0) + gpus
    general = CapacityIndex([], {})
    pool = CapacityIndex([], {})
    capacity: dict[str, int] = {}
    for n in snap.nodes:
        if n.gpus <= 0:
            continue  # a node without GPUs (or with all of them stopping) takes only jobs without
        (pool if n.inference_pool else general).add_node(n, n.gpus - used.get(n.name, 0))
        capacity[n.gpu_type] = capacity.get(n.gpu_type, 0) + n.gpus
    quota = QuotaBook(snap.teams, capacity)
    for (team_name, gpu_type), gpus in held.items():
        quota.add_gpus(team_name, gpu_type, gpus)
    return CycleContext(
        config=config,
        snap=snap,
        now=now,
        nodes=nodes,
        general=general,
        pool=pool,
        capacity=capacity,
        held=held,
        quota=quota,
        busy=busy,
        in_flight=[a for a in snap.running if a.preempting],
    )


def admit(ctx: CycleContext, entry: Entry) -> bool:
    """The admit phase: the entry's team must exist and have quota (its guarantee, or spare
    capacity of its cohort within its borrowing limit)."""
    job = entry.pending.job
    team = ctx.snap.teams.get(job.team)
    if team is None:
        entry.status = EntryStatus.INADMISSIBLE
        ctx.note(entry, f"unknown team {job.team!r}")
        return False
    entry.team = team
    ok, entry.borrowed, why = ctx.quota.admit(team, job)
    if not ok:
        entry.status = EntryStatus.INADMISSIBLE
        ctx.note(entry, why)
    return ok


def place(ctx: CycleContext, entry: Entry) -> bool:
    """The place phase: production inference tries its pool first; then best fit on the general
    index (a shape that failed fails again: free capacity only shrinks during a cycle); then
    backfill into the reservation. Books quota and records the start."""
    job = entry.pending.job
    slots = None
    if job.priority is Priority.PRODUCTION_INFERENCE:
        slots = ctx.pool.place(job)
    # id() of the enum member: a cheap memo key (Enum.__hash__ is Python-level)
    fit_key = (job.gpu_type, id(job.placement), job.tasks, job.gpus_per_task)
    if slots is None and fit_key not in ctx.no_fit:
        slots = ctx.general.place(job)
        if slots is None:
            ctx.no_fit.add(fit_key)
    if slots is None:
        slots = backfill(ctx, entry)
    if slots is None:
        return False
    ctx.quota.add(job.team, slots, ctx.nodes)
    start(ctx, entry, slots)
    return True


def start(ctx: CycleContext, entry: Entry, slots: Slots) -> None:
    job = entry.pending.job
    ctx.result.starts.append(Start(job.id, slots, entry.borrowed))
    ctx.started.append((job, slots))
    entry.status = EntryStatus.STARTED


def place_without_gpus(ctx: CycleContext, entry: Entry) -> bool:
    """A job that needs no GPU: admitted like any other (it books no quota), then each of its
    tasks goes to a different node, the least busy first (ties by name)."""
    if not admit(ctx, entry):
        return False
    job = entry.pending.job
    busy = ctx.busy
    chosen = sorted(ctx.nodes, key=lambda n: (busy.get(n, 0), n))[: job.tasks]
    if len(chosen) < job.tasks:
        entry.status = EntryStatus.BLOCKED
        ctx.note(entry, f"waiting for {job.tasks} ready nodes; {len(chosen)} ready")
        return False
    for name in chosen:
        busy[name] = busy.get(name, 0) + 1
    start(ctx, entry, tuple((name, 0) for name in chosen))
    return True


def explain_rest(ctx: CycleContext, rest: list[PendingJob]) -> None:
    """Reasons for the entries after the cycle ran out of room: quota and free GPUs no longer
    change, so one answer per team and shape."""
    production = Priority.PRODUCTION_INFERENCE
    answers: dict[tuple[object, ...], tuple[str, bool]] = {}
    for later, q in enumerate(rest, start=ctx.higher):
        qjob = q.job
        asks = (
            qjob.team,
            qjob.gpu_type,
            id(qjob.placement),
            qjob.tasks,
            qjob.gpus_per_task,
            qjob.priority is production,
        )
        answer = answers.get(asks)
        if answer is None:
            qteam = ctx.snap.teams.get(qjob.team)
            why = f"unknown team {qjob.team!r}" if qteam is None else ctx.quota.admit(qteam, qjob)[2]
            answer = answers[asks] = (why or ctx.fit_reason(qjob), not why)
        why, ranked = answer
        if ranked and later:
            why = f"{why}; behind {later} job(s) of higher rank"
        ctx.result.reasons[qjob.id] = why


def never_fits(job: Job, nodes: list[Node]) -> str | None:
    """Why ``job`` could not run even on the empty cluster (refuse it at submit), or ``None``.

    Checked against every node at full capacity with the same placement code the cycle uses, so a
    job that is accepted can start once enough work has finished.
    """
    allowed = [n for n in nodes if not n.inference_pool or job.priority is Priority.PRODUCTION_INFERENCE]
    empty = CapacityIndex(allowed, {})
    if empty.place(job, commit=False) is not None:
        return None
    kind = f" {job.gpu_type}" if job.gpu_type else ""
    return f"asks {job.gpus}{kind} GPUs in {WHERE[job.placement]}; the largest there is {empty.largest_block(job)}"
