"""Early-stopping rules of hyperparameter sweeps: ASHA and median stopping.

Both are pure and deterministic (no clock, no I/O), so a Temporal workflow can hold one in its
state and replay it, and the sweep benchmark runs the very same rule in-process.

**ASHA** (asynchronous successive halving, Li et al. 2020): rungs at budgets ``r, rη, rη², …``
below the trial's full budget. A trial that reports its metric at (or past) a rung is recorded
there, and the decision is taken at once, against the trials that reached that rung so far: it
continues only if it is among the best ``max(1, n // η)`` of the ``n`` values recorded at the
rung (itself included). Nothing waits for a rung to fill; the first trials at a rung are
measured against fewer competitors (the first one always continues), which is the price of
never idling a worker. This is the stopping form of ASHA that Optuna's ``SuccessiveHalvingPruner``
and Ray Tune's ``ASHAScheduler`` implement.

**Median stopping** (Golovin et al. 2017, Google Vizier): from ``min_steps`` on, a trial whose
value at a reported step is worse than the median of the other trials' values at that step is
stopped, once at least ``min_trials`` others have reported there.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Literal

Mode = Literal["min", "max"]
Decision = Literal["continue", "stop", "ignore"]
#: Bound on rungs: η ≥ 2 and max_steps below 10^9 give fewer than 30.
MAX_RUNGS = 64


def rungs(min_steps: int, eta: int, max_steps: int) -> list[int]:
    """Rung budgets ``min_steps · eta^k`` strictly below ``max_steps`` (the full budget is not a
    rung: a trial that gets there is complete)."""
    if min_steps < 1 or eta < 2 or max_steps < 1:
        raise ValueError("min_steps >= 1, eta >= 2 and max_steps >= 1 are required")
    out: list[int] = []
    budget = min_steps
    while budget < max_steps and len(out) < MAX_RUNGS:
        out.append(budget)
        budget *= eta
    return out


def _better(a: float, b: float, mode: Mode) -> bool:
    return a < b if mode == "min" else a > b


def _valid(value: float) -> bool:
    return isinstance(value, int | float) and not math.isnan(value)


@dataclass
class Asha:
    """ASHA's promotion rule over one sweep. :meth:`report` records and decides."""

    min_steps: int
    eta: int
    max_steps: int
    mode: Mode = "min"
    recorded: dict[int, dict[str, float]] = field(default_factory=dict)
    """Rung budget → trial → the value it reported there."""
    stopped: dict[str, int] = field(default_factory=dict)
    """Trial → the rung it was stopped at."""
    rungs: list[int] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.rungs = rungs(self.min_steps, self.eta, self.max_steps)
        for rung in self.rungs:
            self.recorded.setdefault(rung, {})

    def report(self, trial: str, step: int, value: float) -> Decision:
        """The trial's metric at ``step``. ``ignore`` when it is no decision point (between rungs,
        a rung it was already judged at, or a trial already stopped); else ``continue`` or
        ``stop``. A NaN or infinite value ranks last (a diverged trial stops when others exist)."""
        if trial in self.stopped:
            return "ignore"
        due = [r for r in self.rungs if r <= step and trial not in self.recorded[r]]
        if not due:
            return "ignore"
        rung = max(due)
        if not _valid(value) or math.isinf(value):
            value = math.inf if self.mode == "min" else -math.inf
        # Rungs skipped by a coarse report count the same value (the trial passed them).
        for r in due:
            self.recorded[r][trial] = value
        if self.promotable(trial, rung):
            return "continue"
        self.stopped[trial] = rung
        return "stop"

    def promotable(self, trial: str, rung: int) -> bool:
        """Is ``trial`` among the best ``max(1, n // eta)`` of the ``n`` recorded at ``rung``?"""
        values = self.recorded[rung]
        keep = max(1, len(values) // self.eta)
        ranked = sorted(values.values(), reverse=self.mode == "max")
        cutoff = ranked[keep - 1]
        mine = values[trial]
        return mine == cutoff or _better(mine, cutoff, self.mode)

    def occupancy(self) -> dict[int, int]:
        """Trials recorded at each rung."""
        return {rung: len(self.recorded[rung]) for rung in self.rungs}

    def forget(self, trial: str) -> None:
        """Drop a trial's records (a failed trial whose values should not judge others)."""
        for values in self.recorded.values():
            values.pop(trial, None)
        self.stopped.pop(trial, None)


@dataclass
class MedianStopping:
    """Median stopping: stop a trial worse than the median of the others at the same step."""

    min_steps: int
    min_trials: int = 3
    mode: Mode = "min"
    recorded: dict[int, dict[str, float]] = field(default_factory=dict)
    """Step → trial → value reported at that step."""
    stopped: dict[str, int] = field(default_factory=dict)

    def report(self, trial: str, step: int, value: float) -> Decision:
        if trial in self.stopped:
            return "ignore"
        at = self.recorded.setdefault(step, {})
        if trial in at:
            return "ignore"
        if not _valid(value) or math.isinf(value):
            value = math.inf if self.mode == "min" else -math.inf
        at[trial] = value
        others = [v for t, v in at.items() if t != trial]
        if step < self.min_steps or len(others) < self.min_trials:
            return "continue"
        median = statistics.median(others)
        if _better(median, value, self.mode):
            self.stopped[trial] = step
            return "stop"
        return "continue"

    def forget(self, trial: str) -> None:
        for values in self.recorded.values():
            values.pop(trial, None)
        self.stopped.pop(trial, None)
