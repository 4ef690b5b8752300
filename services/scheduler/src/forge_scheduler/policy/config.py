"""The knobs of one policy, and the recipes of forge's policy and of the baselines."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Ordering = Literal["forge", "fifo", "multifactor"]


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs of one policy; ``forge()``, ``fifo()``, ``fifo_backfill()``, ``multifactor()`` are the recipes."""

    ordering: Ordering = "forge"
    strict: bool = False
    """Strict FIFO: nothing behind the first job that does not fit may start."""
    backfill: bool = True
    """Reserve for the head-of-line gang that does not fit; others use only what it does not need."""
    preemption: bool = True
    las_tiers_gpu_s: tuple[float, ...] = (2 * 3600.0, 16 * 3600.0, 128 * 3600.0)
    """Attained-service tiers (GPU-seconds): a job that has used less goes first (Tiresias 2D-LAS),
    which favours short jobs without knowing any duration."""
    las_preemption: bool = True
    """Within one priority class, a job of a lower tier may preempt one of a higher tier."""
    aging_s: float = 6 * 3600.0
    """Every ``aging_s`` of waiting lifts a job one tier, so nothing starves under small jobs."""
    starvation_s: float | None = 24 * 3600.0
    """A job that has waited this long since it last entered the queue is *starving*: it goes
    ahead of every job of its priority class that is not (the longest wait first), so it is the
    head of line that holds the reservation while smaller jobs can no longer pass it, and it may
    preempt jobs of its class that have attained more service than it, whatever their tier.
    Waiting time is all it needs to know: no duration. Half the 48-hour bound on a wait, so a
    starving job has as long again to drain its reservation or preempt its way in. ``None``: off
    (the baselines)."""
    preemption_grace_s: float = 60.0
    """Time a victim gets to checkpoint before it must stop."""
    max_preemption_searches: int = 8
    """Bound on victim searches per cycle, which keeps one cycle's cost bounded."""
    max_victims: int = 64
    """A gang that would need more victims than this waits for its reservation instead."""
    multifactor_weights: tuple[float, float, float] = (1000.0, 1000.0, 100.0)
    """Slurm PriorityWeight{Age, FairShare, JobSize}."""
    multifactor_max_age_s: float = 7 * 86400.0
    explain: bool = True
    """Compute a pending reason for every job (the service); the simulator turns it off."""

    @staticmethod
    def forge() -> PolicyConfig:
        return PolicyConfig()

    @staticmethod
    def fifo() -> PolicyConfig:
        return PolicyConfig(ordering="fifo", strict=True, backfill=False, preemption=False, starvation_s=None)

    @staticmethod
    def fifo_backfill() -> PolicyConfig:
        return PolicyConfig(ordering="fifo", backfill=True, preemption=False, starvation_s=None)

    @staticmethod
    def multifactor() -> PolicyConfig:
        return PolicyConfig(ordering="multifactor", backfill=True, preemption=False, starvation_s=None)
