"""Reservation and backfill: the head of the line holds the nodes closest to fitting it.

The first admitted entry that neither fits nor preempts gets the reservation (strict FIFO stops
the line there instead). Later entries backfill only outside it, or inside it when their declared
time limit ends before the reservation's estimated start. forge's order puts a starving job at
the head of its class, so it is the one that holds the reservation until it fits.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from forge_scheduler.policy.capacity import CapacityIndex, Slots
from forge_scheduler.policy.context import CycleContext
from forge_scheduler.policy.decisions import Entry, EntryStatus, Reservation
from forge_scheduler.policy.model import Job, Node, Placement


def reserve(ctx: CycleContext, entry: Entry) -> None:
    """The phase for an admitted entry that neither fits nor preempts: strict FIFO blocks the line
    behind it; otherwise it gets its reason and, if no one holds it yet, the reservation."""
    cfg = ctx.config
    job = entry.pending.job
    entry.status = EntryStatus.BLOCKED
    if cfg.strict:
        ctx.blocked_at = entry.rank
        if cfg.explain:
            ctx.note(entry, ctx.fit_reason(job))
        return
    # the reason first: the reservation takes the nodes it names out of the index
    if cfg.explain:
        reason = ctx.fit_reason(job)
        if ctx.higher:
            reason += f"; behind {ctx.higher} job(s) of higher rank"
        ctx.note(entry, reason)
    if cfg.backfill and ctx.result.reservation is None:
        ctx.result.reservation = hold_nodes(ctx, job)
        entry.status = EntryStatus.RESERVED
    ctx.higher += 1


def backfill(ctx: CycleContext, entry: Entry) -> Slots | None:
    """The backfill phase: a job whose declared limit ends before the reservation starts may use
    reserved nodes (the GPUs it takes are booked so later backfills see them)."""
    job = entry.pending.job
    reservation = ctx.result.reservation
    if reservation is None or reservation.estimated_start is None or job.time_limit_s is None:
        return None
    if ctx.now + job.time_limit_s > reservation.estimated_start:
        return None
    side = CapacityIndex([], {})
    for name in reservation.nodes:
        side.add_node(ctx.nodes[name], ctx.reserved_free[name])
    slots = side.place(job, commit=False)
    # reserved nodes stay out of the general index
    for name, gpus in slots or ():
        ctx.reserved_free[name] -= gpus
    return slots


def hold_nodes(ctx: CycleContext, job: Job) -> Reservation:
    """Hold the nodes closest to fitting ``job``; estimate its start where limits are known.

    Nodes go most-free first and, among equally free ones, the one whose jobs' declared limits
    end first. End times are looked up only for the nodes that can be chosen: scanning every
    running job per node would cost more than the rest of the cycle.
    """
    index, now = ctx.general, ctx.now
    ends: dict[str, float] = {}

    def look_up_ends(names: Iterable[str]) -> None:
        wanted = {name for name in names if name not in ends}
        if not wanted:
            return
        found: dict[str, float] = {}

        def note(name: str, holder: Job, since: float) -> None:
            end = math.inf if holder.time_limit_s is None else since + holder.time_limit_s
            found[name] = max(found.get(name, -math.inf), end)

        for a in ctx.snap.running:
            if not a.job.gpus:
                continue  # jobs without GPUs hold none of what the reservation waits for
            for name, _ in a.slots:
                if name in wanted:
                    note(name, a.job, a.start_time)
        for j, slots in ctx.started:  # started earlier in this cycle
            for name, _ in slots:
                if name in wanted:
                    note(name, j, now)
        for name in wanted:
            ends[name] = found.get(name, now)  # a node without jobs is free now

    types = index.types_for(job)
    chosen: list[Node] = []
    if job.placement is Placement.SAME_NODE:
        for _, level in index.by_free(types):
            fits = [n for n in level if n.gpus >= job.gpus]
            if fits:
                look_up_ends(n.name for n in fits)
                chosen = [min(fits, key=lambda n: (ends[n.name], n.name))]
                break
    elif job.placement is Placement.SAME_GROUP:
        candidates = [n for n in index.nodes.values() if n.gpu_type in types]
        groups: dict[str, list[Node]] = {}
        for n in candidates:
            groups.setdefault(n.group, []).append(n)
        best = sorted(groups.items(), key=lambda kv: (-sum(index.free[n.name] for n in kv[1]), kv[0]))
        if best:
            members = sorted(best[0][1], key=lambda n: (-index.free[n.name], n.name))
            total = 0
            for n in members:
                chosen.append(n)
                total += n.gpus
                if total >= job.gpus:
                    break
        look_up_ends(n.name for n in chosen)
    else:
        # whole levels until they hold the gang; only the last level's order depends on ends
        levels: list[list[Node]] = []
        total = 0
        for _, level in index.by_free(types):
            levels.append(level)
            total += sum(n.gpus for n in level)
            if total >= job.gpus:
                break
        look_up_ends(n.name for level in levels for n in level)
        total = 0
        for level in levels:
            for n in sorted(level, key=lambda n: (ends[n.name], n.name)):
                chosen.append(n)
                total += n.gpus
                if total >= job.gpus:
                    break
            if total >= job.gpus:
                break
    est = max((ends[n.name] for n in chosen), default=now)
    for n in chosen:
        ctx.reserved_free[n.name] = index.remove_node(n.name)
    return Reservation(job.id, tuple(n.name for n in chosen), None if math.isinf(est) else est)
