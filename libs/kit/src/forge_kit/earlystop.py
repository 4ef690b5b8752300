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

**ASHA, promotion form** (:class:`AshaPromotion`, Algorithm 2 of the paper): a trial that
reaches a rung *pauses* there (its job checkpoints and ends) unless it is promotable at once; a
free worker first resumes the best promotable paused trial of the highest rung that has one (in
the top ``n // η`` of its rung's ``n`` values and not promoted yet), and only then starts a new
configuration. No trial goes on for lack of competitors, so the first arrivals at a rung cost
nothing extra; the price is a resumption from a checkpoint. With a finite set of configurations,
once none is left to start and no trial can still reach a rung, that rung promotes its top
``max(1, n // η)``: the sweep always ends with at least one trial at the full budget.

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
Decision = Literal["continue", "stop", "ignore", "pause"]
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
class AshaPromotion:
    """ASHA's promotion form over one sweep (see the module docstring). :meth:`report` records a
    trial's value at a rung and says ``continue`` (promotable now) or ``pause``;
    :meth:`next_promotion` names the paused trial a free worker should resume."""

    min_steps: int
    eta: int
    max_steps: int
    mode: Mode = "min"
    recorded: dict[int, dict[str, float]] = field(default_factory=dict)
    """Rung budget → trial → the value it reported there."""
    promoted: dict[int, list[str]] = field(default_factory=dict)
    """Rung budget → trials promoted out of it, in order."""
    rungs: list[int] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.rungs = rungs(self.min_steps, self.eta, self.max_steps)
        for rung in self.rungs:
            self.recorded.setdefault(rung, {})
            self.promoted.setdefault(rung, [])

    def report(self, trial: str, step: int, value: float) -> Decision:
        """The trial's metric at ``step``: ``ignore`` off a new rung; at one, ``continue`` when
        the trial is promotable there at once (it is then promoted), else ``pause``."""
        due = [r for r in self.rungs if r <= step and trial not in self.recorded[r]]
        if not due:
            return "ignore"
        if not _valid(value) or math.isinf(value):
            value = math.inf if self.mode == "min" else -math.inf
        for r in due:
            self.recorded[r][trial] = value
            if r != max(due):
                self.promoted[r].append(trial)  # a coarse report passed it
        rung = max(due)
        if trial in self._candidates(rung, final=False):
            self.promoted[rung].append(trial)
            return "continue"
        return "pause"

    def _candidates(self, rung: int, final: bool) -> list[str]:
        """Trials of ``rung`` in its top ``n // eta`` (``max(1, n // eta)`` when ``final``), best
        first, not promoted yet."""
        values = self.recorded[rung]
        keep = len(values) // self.eta
        if final:
            keep = max(1, keep)
        ranked = sorted(values, key=lambda t: values[t], reverse=self.mode == "max")[:keep]
        return [t for t in ranked if t not in self.promoted[rung]]

    def next_promotion(self, final_below: int = 0) -> tuple[str, int] | None:
        """The paused trial to resume and the rung it leaves, highest rung first; None when none
        is promotable. ``final_below``: rungs at or below this budget can gain no more trials
        (none left to start and none in flight under them), so they promote at least one."""
        for rung in reversed(self.rungs):
            found = self._candidates(rung, final=rung <= final_below)
            if found:
                self.promoted[rung].append(found[0])
                return found[0], rung
        return None

    def paused_at(self, trial: str) -> int | None:
        """The rung a trial waits at (recorded there, not promoted out of it), if any."""
        waiting = [r for r in self.rungs if trial in self.recorded[r] and trial not in self.promoted[r]]
        return max(waiting) if waiting else None

    def reached(self, trial: str) -> int:
        """The highest rung the trial reported at (0: none yet): a trial in flight can still
        join only the rungs above it."""
        return max((r for r in self.rungs if trial in self.recorded[r]), default=0)

    def occupancy(self) -> dict[int, int]:
        """Trials recorded at each rung."""
        return {rung: len(self.recorded[rung]) for rung in self.rungs}

    def forget(self, trial: str) -> None:
        """Drop a trial's records (a failed trial whose values should not judge others)."""
        for values in self.recorded.values():
            values.pop(trial, None)
        for out in self.promoted.values():
            if trial in out:
                out.remove(trial)


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
