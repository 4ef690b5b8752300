"""Preemption: which running jobs an entry that does not fit may stop, and the search for the
cheapest set of them that lets it fit.

Victims are running jobs past their minimum runtime, not production inference, not already
stopping, holding GPUs. An entry may stop a victim of a lower priority class; of its own class, one
that borrows quota the entry's team is guaranteed, one of a higher attained-service tier (LAS), or,
when the entry is starving, one that has attained more service than it. Cost = GPUs × time since
the victim's last checkpoint; the cheapest set wins.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from forge_scheduler.policy.capacity import Slots
from forge_scheduler.policy.context import CycleContext
from forge_scheduler.policy.decisions import Entry, EntryStatus, Preemption
from forge_scheduler.policy.model import ANY_GPU_TYPE, Allocation, Placement, Priority
from forge_scheduler.policy.order import effective_tier, starving, tier

Plan = tuple[list[tuple[Allocation, str]], list[str], bool]
"""(victims with the reason for each, nodes to hold, whether only in-flight stops were needed)."""


@dataclass(frozen=True, eq=False)
class Victim:
    cost: float
    job_id: str
    alloc: Allocation
    tier: int
    attained: float
    cohort: str


class VictimQueue:
    """The victim pool in cost order, sorted lazily from a heap: a search usually stops after the
    first few victims, and most cycles search a few times, so sorting every running job is waste.

    Iterating it again starts from the cheapest; ties in cost go by job id, then snapshot order.
    """

    def __init__(self, ctx: CycleContext, keys: list[tuple[float, str, int]]) -> None:
        heapq.heapify(keys)
        self._heap = keys
        self._sorted: list[Victim] = []
        self._ctx = ctx

    def _pop(self) -> Victim:
        cost, job_id, i = heapq.heappop(self._heap)
        ctx = self._ctx
        a = ctx.snap.running[i]
        team = ctx.snap.teams.get(a.job.team)
        attained = a.attained(ctx.now)
        victim = Victim(cost, job_id, a, tier(ctx.config, attained), attained, team.cohort if team else "")
        self._sorted.append(victim)
        return victim

    def __iter__(self) -> Iterator[Victim]:
        for i in itertools.count():
            if i < len(self._sorted):
                yield self._sorted[i]
            elif self._heap:
                yield self._pop()
            else:
                return


def victim_pool(ctx: CycleContext) -> VictimQueue:
    """Running jobs that may be preempted at all, cheapest first."""
    keys: list[tuple[float, str, int]] = []
    append = keys.append
    production = Priority.PRODUCTION_INFERENCE
    now = ctx.now
    for i, a in enumerate(ctx.snap.running):
        v = a.job
        start = a.start_time
        gpus = v.tasks * v.gpus_per_task
        if a.preempting or v.priority is production or now - start < v.min_runtime_s or not gpus:
            continue
        # Allocation.last_checkpoint, inlined: this loop runs over every running job
        last = a.last_checkpoint_time
        if last is None:
            last = start
            interval = a.checkpoint_interval_s
            if interval and v.checkpointable:
                last = start + (max(0.0, now - start) // interval) * interval
        append((gpus * max(0.0, now - last), v.id, i))
    return VictimQueue(ctx, keys)


def victim_reason(ctx: CycleContext, victim: Victim, entry: Entry, my_tier: int, hungry: bool) -> str | None:
    """Why ``victim`` may be preempted for ``entry``, or ``None`` if it may not."""
    p, team = entry.pending, entry.team
    job, v = p.job, victim.alloc.job
    assert team is not None  # admitted
    if v.priority < job.priority:
        return f"preempted by higher priority {job.priority.name.lower()} job {job.id}"
    if v.priority > job.priority:
        return None
    if (
        victim.alloc.borrowed
        and v.team != job.team
        and victim.cohort == team.cohort
        and ctx.quota.within_guarantee(team, job.gpu_type, job.gpus)
    ):
        return f"borrowed quota reclaimed by team {job.team}"
    if ctx.config.las_preemption and victim.tier > my_tier:
        return f"yielded to job {job.id} with less attained service (tier {my_tier} < {victim.tier})"
    if hungry and victim.attained > p.attained_gpu_s:
        hours = (ctx.now - p.waiting_since) / 3600.0
        return f"yielded to job {job.id}, starving after {hours:.0f} h in the queue"
    return None


def preempt(ctx: CycleContext, entry: Entry) -> bool:
    """The preempt phase for an admitted entry that did not fit: choose victims (or wait for
    stops already in flight) and hold the nodes they free. False when no search is left this
    cycle or none succeeds (a search that failed for this class, tier and shape fails again)."""
    cfg = ctx.config
    if ctx.searches >= ctx.max_searches:
        return False
    p, team = entry.pending, entry.team
    job = p.job
    assert team is not None  # admitted
    my_tier = effective_tier(cfg, p, ctx.now)
    hungry = starving(cfg, p, ctx.now)
    shape = (
        int(job.priority),
        my_tier,
        job.gpus,
        id(job.placement),
        job.gpu_type,
        ctx.quota.within_guarantee(team, job.gpu_type, job.gpus),
        p.attained_gpu_s if hungry else None,
    )
    if shape in ctx.failed_searches:
        return False
    ctx.searches += 1
    if ctx.victims is None:
        ctx.victims = victim_pool(ctx)
    plan = (one_node if job.placement is Placement.SAME_NODE and job.gpu_type != ANY_GPU_TYPE else gang)(
        ctx, entry, my_tier, hungry
    )
    if plan is None:
        ctx.failed_searches.add(shape)
        return False
    chosen, hold, waiting_only = plan
    for v, reason in chosen:
        ctx.claimed.add(v.job.id)
        stop_by = ctx.now + (cfg.preemption_grace_s if v.job.checkpointable else 0.0)
        ctx.result.preemptions.append(Preemption(v.job.id, job.id, reason, stop_by))
    for name in hold:
        if name in ctx.general.nodes:
            ctx.general.remove_node(name)
    entry.status = EntryStatus.PREEMPTING
    if cfg.explain:
        ctx.note(
            entry,
            "waiting for preempted jobs to checkpoint and stop"
            if waiting_only
            else f"preempting {len(chosen)} job(s); starts after the {cfg.preemption_grace_s:.0f} s grace period",
        )
    ctx.higher += 1
    return True


def gang(ctx: CycleContext, entry: Entry, my_tier: int, hungry: bool) -> Plan | None:
    """Cheapest victim set that lets the entry fit, with the nodes to hold for it; ``None`` if none.

    Victims already being preempted count as free first (no new victims are then needed).
    """
    job = entry.pending.job
    assert ctx.victims is not None
    # trial on the real index, undone before returning: copying 1,000 nodes costs more
    trial = ctx.general
    given: list[Slots] = []

    def free_up(slots: Slots) -> None:
        mine = tuple((n, g) for n, g in slots if n in trial.nodes)
        trial.give(mine)
        given.append(mine)

    def undo() -> None:
        for slots in reversed(given):
            trial.take(slots)

    pending_free = [a for a in ctx.in_flight if a.job.id not in ctx.claimed]
    for a in pending_free:
        free_up(a.slots)
    slots = trial.place(job, commit=False)
    if slots is not None and pending_free:
        undo()
        return [], sorted({n for n, _ in slots}), True
    chosen: list[tuple[Victim, str]] = []
    for c in ctx.victims:
        if c.job_id in ctx.claimed or any(n not in trial.nodes for n, _ in c.alloc.slots):
            continue
        why = victim_reason(ctx, c, entry, my_tier, hungry)
        if why is None:
            continue
        chosen.append((c, why))
        if len(chosen) > ctx.config.max_victims:
            undo()
            return None
        free_up(c.alloc.slots)
        # only a node that now holds a whole task can change the answer
        helps = any(trial.free[n] >= job.gpus_per_task for n, _ in c.alloc.slots)
        if helps and trial.place(job, commit=False) is not None:
            break
    else:
        undo()
        return None
    # prune victims that turned out unnecessary, most expensive first
    dropped: set[str] = set()
    for victim, _ in sorted(chosen, key=lambda i: (-i[0].cost, i[0].job_id)):
        trial.take(victim.alloc.slots)
        if trial.place(job, commit=False) is None:
            trial.give(victim.alloc.slots)
        else:
            dropped.add(victim.job_id)
            given.remove(victim.alloc.slots)
    chosen = [item for item in chosen if item[0].job_id not in dropped]
    slots = trial.place(job, commit=False)
    undo()
    hold = sorted({n for n, _ in slots or ()})
    return [(c.alloc, why) for c, why in chosen], hold, False


def one_node(ctx: CycleContext, entry: Entry, my_tier: int, hungry: bool) -> Plan | None:
    """Single-node gangs: per node, add the cheapest eligible victims until the gang fits; the
    first node to fit wins (its most expensive victim is the cheapest possible)."""
    job = entry.pending.job
    general = ctx.general
    assert ctx.victims is not None
    need = job.gpus
    gained: dict[str, int] = {}
    for a in ctx.in_flight:
        if a.job.id in ctx.claimed:
            continue
        for name, gpus in a.slots:
            if name in general.nodes and general.nodes[name].gpu_type == job.gpu_type:
                gained[name] = gained.get(name, 0) + gpus
                if general.free[name] + gained[name] >= need:
                    return [], [name], True
    picked: dict[str, list[tuple[Allocation, str]]] = {}
    for c in ctx.victims:
        if c.job_id in ctx.claimed:
            continue
        names = [
            n for n, _ in c.alloc.slots if n in general.nodes and general.nodes[n].gpu_type == job.gpu_type
        ]
        if not names:
            continue
        why = victim_reason(ctx, c, entry, my_tier, hungry)
        if why is None:
            continue
        for name, gpus in c.alloc.slots:
            if name not in general.nodes or general.nodes[name].gpu_type != job.gpu_type:
                continue
            gained[name] = gained.get(name, 0) + gpus
            chosen = picked.setdefault(name, [])
            if not chosen or chosen[-1][0] is not c.alloc:
                chosen.append((c.alloc, why))
            if general.free[name] + gained[name] >= need and general.nodes[name].gpus >= need:
                return chosen, [name], False
    return None
