"""Cluster figures the service exports and the simulator averages: utilisation, fragmentation,
weighted max-min fair shares and Jain's index over allocation / fair share."""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def utilisation(allocated_gpus: int, total_gpus: int) -> float:
    return allocated_gpus / total_gpus if total_gpus else 0.0


def fragmented_gpus(free_by_node: Mapping[str, int], pending_task_sizes: Iterable[int]) -> int:
    """Free GPUs on nodes where not even the smallest pending task fits (none pending → 0).

    A free GPU is only waste if someone is waiting and cannot use it; with nobody waiting an idle
    GPU is idle, not fragmented.
    """
    smallest = min(pending_task_sizes, default=None)
    if smallest is None:
        return 0
    return sum(free for free in free_by_node.values() if 0 < free < smallest)


def fair_shares(
    capacity: float, demand: Mapping[str, float], weight: Mapping[str, float]
) -> dict[str, float]:
    """Weighted max-min (water-filling) shares of ``capacity``, none above its team's demand."""
    shares = dict.fromkeys(demand, 0.0)
    active = {t for t, d in demand.items() if d > 0}
    left = capacity
    while active and left > 1e-9:
        total_w = sum(weight.get(t, 1.0) for t in active)
        step = {t: left * weight.get(t, 1.0) / total_w for t in active}
        left = 0.0
        for t in sorted(active):
            give = min(step[t], demand[t] - shares[t])
            shares[t] += give
            left += step[t] - give
        active = {t for t in active if demand[t] - shares[t] > 1e-9}
    return shares


def jain_index(values: Iterable[float]) -> float:
    """(Σx)² / (n·Σx²): 1 when all equal, 1/n when one takes all."""
    xs = list(values)
    if not xs:
        return 1.0
    square_sum = sum(x * x for x in xs)
    return (sum(xs) ** 2) / (len(xs) * square_sum) if square_sum > 0 else 1.0


def fairness(
    capacity: float, allocation: Mapping[str, float], demand: Mapping[str, float], weight: Mapping[str, float]
) -> tuple[float, float]:
    """(Jain's index over allocation / fair share, mean absolute share deviation in GPUs)."""
    shares = fair_shares(capacity, demand, weight)
    teams = [t for t, s in shares.items() if s > 0]
    ratios = [allocation.get(t, 0.0) / shares[t] for t in teams]
    deviation = sum(abs(allocation.get(t, 0.0) - shares[t]) for t in teams) / len(teams) if teams else 0.0
    return jain_index(ratios), deviation
