"""Ordering: the pending jobs in the order a cycle considers them.

forge's order is priority class, then starvation (a job that has waited longer than
``starvation_s`` since it last entered the queue goes ahead of its class, the longest wait
first), then attained-service tier with aging, then the
team's weighted dominant share with decayed usage, then waiting time, then job id. The baselines
sort by submit time (FIFO) or by Slurm's multifactor priority.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence

import numpy as np

from forge_scheduler.policy.config import PolicyConfig
from forge_scheduler.policy.model import PendingJob, Snapshot


def tier(config: PolicyConfig, attained_gpu_s: float) -> int:
    """Attained-service tier: 0 for a job that has used less than the first threshold."""
    return bisect.bisect_right(config.las_tiers_gpu_s, attained_gpu_s)


def effective_tier(config: PolicyConfig, p: PendingJob, now: float) -> int:
    """Tier lowered by one per ``aging_s`` waited, so a long job cannot starve."""
    return max(0, tier(config, p.attained_gpu_s) - int(max(0.0, now - p.waiting_since) // config.aging_s))


def starving(config: PolicyConfig, p: PendingJob, now: float) -> bool:
    """Whether ``p`` has waited past the starvation threshold since it last entered the queue."""
    return config.starvation_s is not None and now - p.waiting_since >= config.starvation_s


def fair_scores(
    snap: Snapshot, capacity: Mapping[str, int], held: Mapping[tuple[str, str], int]
) -> dict[str, float]:
    """Weighted dominant share of current allocation plus share of decayed usage (lower first).

    ``held``: GPUs in use per (team, GPU type).
    """
    total_usage = sum(snap.usage.values()) or 1.0
    scores: dict[str, float] = {}
    for team in snap.teams.values():
        dominant = max(
            (held.get((team.name, t), 0) / cap for t, cap in capacity.items() if cap > 0), default=0.0
        )
        scores[team.name] = (dominant + snap.usage.get(team.name, 0.0) / total_usage) / max(team.weight, 1e-9)
    return scores


def order(
    config: PolicyConfig,
    snap: Snapshot,
    pending: Sequence[PendingJob],
    now: float,
    capacity: Mapping[str, int],
    held: Mapping[tuple[str, str], int],
) -> tuple[list[PendingJob], list[str]]:
    """The ``pending`` jobs in the order the cycle considers them, and their ids."""
    if config.ordering != "forge":
        return order_baseline(config, snap, pending, now, capacity)
    fair = fair_scores(snap, capacity, held)
    tiers = config.las_tiers_gpu_s
    first = tiers[0] if tiers else math.inf
    aging = config.aging_s
    starve = math.inf if config.starvation_s is None else config.starvation_s
    bisect_right = bisect.bisect_right
    # The key is (head, waiting since, job id), head = priority, starvation, tier and the team's
    # fair score as one small integer (the score enters as its rank; a starving job's head is the
    # smallest of its class). It is sorted as three stable passes over plain lists, least
    # significant first, instead of one sort of per-job tuples: 10,000 tuples cost more to build
    # than to sort, and they are the bulk of what a cycle allocates (each allocation burst brings
    # the cyclic garbage collector closer).
    ranks = {score: r for r, score in enumerate(sorted({*fair.values(), 0.0}))}
    team_rank = {team: ranks[score] for team, score in fair.items()}
    unknown = ranks[0.0]
    per_tier = len(ranks)
    per_priority = (len(tiers) + 1) * per_tier + 1
    heads: list[int] = []
    sinces: list[float] = []
    ids: list[str] = []
    add_head, add_since, add_id = heads.append, sinces.append, ids.append
    for p in pending:
        job = p.job
        since = job.submit_time if p.queued_since is None else p.queued_since
        head = -int(job.priority) * per_priority
        if now - since < starve:  # a starving job's head is the smallest of its class
            head += 1 + team_rank.get(job.team, unknown)
            attained = p.attained_gpu_s
            if attained >= first:
                tier = bisect_right(tiers, attained)
                if now > since:
                    tier = max(0, tier - int((now - since) // aging))
                head += tier * per_tier
        add_head(head)
        add_since(since)
        add_id(job.id)
    ranked = sorted(range(len(ids)), key=ids.__getitem__)
    ranked.sort(key=sinces.__getitem__)
    ranked.sort(key=heads.__getitem__)
    return [pending[i] for i in ranked], [ids[i] for i in ranked]


def order_baseline(
    config: PolicyConfig,
    snap: Snapshot,
    pending: Sequence[PendingJob],
    now: float,
    capacity: Mapping[str, int],
) -> tuple[list[PendingJob], list[str]]:
    """Strict FIFO and FIFO + backfill: submit time; multifactor: Slurm's weighted sum.

    Ties go to the lower job id. A long queue is re-sorted every cycle, so the keys are numpy
    columns sorted in C (:func:`lex_order`) rather than a Python key per job.
    """
    jobs = [p.job for p in pending]
    ids = [job.id for job in jobs]
    submit = np.array([job.submit_time for job in jobs], dtype=np.float64)
    if config.ordering == "fifo":
        ranked = lex_order([submit], ids)
    elif config.ordering == "multifactor":
        w_age, w_fs, w_size = config.multifactor_weights
        total = sum(capacity.values()) or 1
        usage_total = sum(snap.usage.values()) or 1.0
        weights_total = sum(t.weight for t in snap.teams.values()) or 1.0
        fs: dict[str, float] = {}
        for team in snap.teams.values():
            share = team.weight / weights_total
            fs[team.name] = 2.0 ** (-(snap.usage.get(team.name, 0.0) / usage_total) / share)
        fs_of = fs.get
        # Slurm's job priority: age (capped), fair share and size, each weighted; higher first.
        age = np.minimum(1.0, np.maximum(0.0, now - submit) / config.multifactor_max_age_s)
        share_col = np.array([fs_of(job.team, 0.0) for job in jobs], dtype=np.float64)
        size = np.array([job.tasks * job.gpus_per_task for job in jobs], dtype=np.float64)
        score = w_age * age + w_fs * share_col + w_size * size / total
        priority = np.array([int(job.priority) for job in jobs], dtype=np.float64)
        ranked = lex_order([-priority, -score, submit], ids)
    else:
        raise ValueError(f"ordering: unknown {config.ordering!r}")
    return [pending[i] for i in ranked], [ids[i] for i in ranked]


def lex_order(keys: list[np.ndarray], ids: list[str]) -> list[int]:
    """Indices sorting by ``keys`` (most significant first), then by id where every key ties.

    1. A stable lexicographic sort of the numeric keys in C.
    2. The runs where all keys tie (rare) are re-sorted by job id, so the order never depends on
       the order the snapshot listed the jobs in.
    """
    if not ids:
        return []
    # 1. numeric keys (np.lexsort takes the most significant last)
    ranked = np.lexsort(keys[::-1])
    tied = np.ones(len(ids) - 1, dtype=bool)
    for key in keys:
        column = key[ranked]
        tied &= column[1:] == column[:-1]
    result: list[int] = ranked.tolist()
    # 2. ties by id: a run spans positions start..end where tied[start:end] are all True
    if tied.any():
        edges = np.flatnonzero(np.diff(np.concatenate(([False], tied, [False])).astype(np.int8)))
        for start, end in zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True):
            result[start : end + 1] = sorted(result[start : end + 1], key=ids.__getitem__)
    return result
