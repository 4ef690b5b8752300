"""Early-stopping rules of hyperparameter sweeps: the guarded rule (the default), ASHA and
median stopping; and how far a sweep's rungs could be trusted (:func:`rung_trust`).

All are pure and deterministic (no clock, no I/O), so a Temporal workflow can hold one in its
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

**Guarded** (:class:`Guarded`, the default of a space's ``early_stopping``): ASHA's promotion
form with guards against successive halving's short-horizon bias (a configuration that leads
early, typically a high learning rate, is not the one that leads at the end of the schedule),
so that it needs no hand-picked first rung: its rungs are a 27th, a 9th and a third of the
budget (:func:`default_min_steps`). Nothing stops at the first rung (it is where the ranking is
first measured). From the second on, a rung promotes its top ``n // η`` and also every trial
still catching up on the leader: its gap to the leader, less the ground it has gained on the
leader since the rung before (per unit of log step, carried on to the full budget: a lower rate
still descending fast), is not positive. Two more guards are settings, off by default (the
replays of load/sweep/RESULTS.md priced them out): a noise margin (``z · √2 · σ``,
:func:`curve_noise`) and a settled ranking (every trial promoted while Kendall's τ between the
rung and the rung before is under ``settled_tau``). The guards only ever promote more than
ASHA would.

**Median stopping** (Golovin et al. 2017, Google Vizier): from ``min_steps`` on, a trial whose
value at a reported step is worse than the median of the other trials' values at that step is
stopped, once at least ``min_trials`` others have reported there.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Literal

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


def default_min_steps(max_steps: int, eta: int = 3) -> int:
    """The first rung of a rule with no ``min_steps``: ``max_steps / eta³`` (9 of 243 steps), so
    the rungs are ``max_steps / eta³``, ``/ eta²`` and ``/ eta`` (9, 27, 81 of 243)."""
    return max(1, max_steps // eta**3)


def _ranks(values: list[float]) -> list[float]:
    """Average ranks (ties share the mean of their places)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2.0
        i = j + 1
    return out


def kendall_tau(xs: list[float], ys: list[float]) -> float:
    """Kendall's τ-b of paired values (NaN under 2 pairs or with a constant side). Pure Python:
    a workflow's rule calls it, and rungs hold at most a few thousand trials."""
    n = len(xs)
    concordant = discordant = ties_x = ties_y = 0
    for i in range(n):
        for j in range(i + 1, n):
            dx, dy = xs[i] - xs[j], ys[i] - ys[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                ties_x += 1
            elif dy == 0:
                ties_y += 1
            elif (dx > 0) == (dy > 0):
                concordant += 1
            else:
                discordant += 1
    denominator = math.sqrt((concordant + discordant + ties_x) * (concordant + discordant + ties_y))
    return (concordant - discordant) / denominator if denominator > 0 else math.nan


def spearman_rho(xs: list[float], ys: list[float]) -> float:
    """Spearman's ρ of paired values (NaN under 2 pairs or with a constant side)."""
    if len(xs) < 2:
        return math.nan
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else math.nan


def curve_noise(curves: list[list[tuple[int, float]]]) -> float:
    """The evaluation noise the curves show: per curve, the root mean square of its second
    differences over ``√6`` (the standard deviation of independent noise on a locally straight
    curve; curvature only adds to it, so the estimate errs large), the median over curves with
    at least three points (0.0 when none has)."""
    per_curve: list[float] = []
    for curve in curves:
        ys = [v for _, v in curve if _valid(v) and not math.isinf(v)]
        if len(ys) < 3:
            continue
        second = [ys[i - 1] - 2 * ys[i] + ys[i + 1] for i in range(1, len(ys) - 1)]
        per_curve.append(math.sqrt(sum(d * d for d in second) / len(second) / 6.0))
    return statistics.median(per_curve) if per_curve else 0.0


@dataclass
class Guarded(AshaPromotion):
    """ASHA's promotion form with guards against its short-horizon bias (see the module
    docstring). A rung promotes its top ``n // eta`` as ASHA does, and besides them:

    - *every* trial while the ranking there has not settled: Kendall's τ between the values at
      this rung and at the rung before it, over the trials recorded at both (at least
      ``min_pairs``), is under ``settled_tau`` (the first rung has none before it, so it always
      promotes all: it is where the ranking is first measured);
    - a trial the leader of the rung does not clearly beat: its gap to the leader, less the
      catch-up its own curve shows (the gap it closed since the rung before, per unit of log
      step, carried on to ``max_steps``), is within ``z · √2 · σ``, σ the evaluation noise of
      the trials' curves (:func:`curve_noise`).

    By default (``settled_tau`` -1, ``z`` 0) only the catch-up guard is on. It needs every
    evaluation of a trial, not only the rungs' (:meth:`report` keeps them)."""

    z: float = 0.0
    """Noise margin in units of √2·σ (0: none; 2 measured, RESULTS.md 2026-12-06: too costly)."""
    settled_tau: float = -1.0
    """τ a rung's ranking needs before anything stops there (-1: any; 0.6 measured: the
    rankings of the recorded spaces never reached it, so every trial ran to the end)."""
    min_pairs: int = 3
    project: float = 1.0
    """How much of the catch-up to carry on (0: none; 1: the whole log-step distance left)."""
    unsettled_keep: float = 1.0
    """Share of a rung (best first) promoted while its ranking has not settled."""
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """Trial → (step, value) of every evaluation it reported, in step order."""

    def report(self, trial: str, step: int, value: float) -> Decision:
        clean = (
            value
            if _valid(value) and not math.isinf(value)
            else (math.inf if self.mode == "min" else -math.inf)
        )
        kept = self.history.setdefault(trial, [])
        if not kept or step > kept[-1][0]:
            kept.append((step, clean))
        return super().report(trial, step, value)

    def _sign(self) -> float:
        return 1.0 if self.mode == "min" else -1.0

    def settled(self, rung: int) -> bool | None:
        """Is the ranking at ``rung`` the ranking at the rung before it (τ ≥ ``settled_tau``)?
        None: too few trials at both to say (under ``min_pairs``)."""
        index = self.rungs.index(rung)
        if index == 0:
            return False
        before, here = self.recorded[self.rungs[index - 1]], self.recorded[rung]
        both = [t for t in here if t in before and math.isfinite(here[t]) and math.isfinite(before[t])]
        if len(both) < self.min_pairs:
            return None
        tau = kendall_tau([before[t] for t in both], [here[t] for t in both])
        return not math.isnan(tau) and tau >= self.settled_tau

    def noise(self, rung: int) -> float:
        """σ of the curves of the trials recorded at ``rung``, up to it."""
        return curve_noise(
            [[(s, v) for s, v in self.history.get(t, []) if s <= rung] for t in self.recorded[rung]]
        )

    def _value_at(self, trial: str, step: int) -> float | None:
        for s, v in self.history.get(trial, []):
            if s == step:
                return v
        return None

    def protected(self, trial: str, rung: int, leader: str, sigma: float) -> bool:
        """Does the leader of ``rung`` fail to clearly beat ``trial`` (see the class docstring)?"""
        values, sign = self.recorded[rung], self._sign()
        gap = sign * (values[trial] - values[leader])
        if not math.isfinite(gap):
            return False
        margin = self.z * math.sqrt(2.0) * sigma
        index = self.rungs.index(rung)
        if self.project and index > 0:
            before = self.rungs[index - 1]
            mine, theirs = self._value_at(trial, before), self._value_at(leader, before)
            if mine is not None and theirs is not None and math.isfinite(sign * (mine - theirs)):
                closed = sign * (mine - theirs) - gap  # > 0: the trial gained on the leader
                per_log = closed / math.log(rung / before)
                gap -= self.project * max(0.0, per_log) * math.log(self.max_steps / rung)
        return gap <= margin

    def _candidates(self, rung: int, final: bool) -> list[str]:
        values = self.recorded[rung]
        keep = len(values) // self.eta
        if final:
            keep = max(1, keep)
        ranked = sorted(values, key=lambda t: self._sign() * values[t])
        chosen = set(ranked[:keep])
        settled = self.settled(rung) if ranked else True
        if settled is None:  # too few trials to say yet: they wait, unless none can come
            chosen = set(ranked) if final else set()
        elif not settled:  # the ranking is still moving: every trial goes on (or a share)
            chosen = set(ranked[: max(keep, math.ceil(self.unsettled_keep * len(ranked)))])
        elif ranked:
            sigma = self.noise(rung)
            chosen |= {t for t in ranked[keep:] if self.protected(t, rung, ranked[0], sigma)}
        return [t for t in ranked if t in chosen and t not in self.promoted[rung]]


def _at(curve: list[tuple[int, float]], step: int) -> float | None:
    """A curve's value at ``step`` (the first one reported at or past it)."""
    for s, v in curve:
        if s >= step:
            return v
    return None


def _or_none(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 4)


def rung_trust(
    curves: dict[str, list[tuple[int, float]]],
    finals: dict[str, float],
    stopped: dict[str, int],
    rungs_: list[int],
    mode: Mode = "min",
    z: float = 2.0,
) -> dict[str, Any]:
    """How far a sweep's rungs can be trusted, from what it saw: per rung, the rank correlation
    (Spearman's ρ, Kendall's τ) between the values at the rung and the final values of the
    trials that finished (``finals``); the evaluation noise σ of the curves (:func:`curve_noise`);
    and how many of the ``stopped`` trials (trial → the rung it ended at) were, at that rung,
    within ``z · √2 · σ`` of the best value recorded there: stops the data could not justify.
    ``curves``: trial → (step, value) as the rule judged them."""
    sign = 1.0 if mode == "min" else -1.0
    sigma = curve_noise(list(curves.values()))
    margin = z * math.sqrt(2.0) * sigma
    per_rung: dict[str, Any] = {}
    for rung in rungs_:
        pairs = [(_at(curves.get(t, []), rung), f) for t, f in finals.items()]
        xs = [x for x, f in pairs if x is not None and math.isfinite(x) and math.isfinite(f)]
        ys = [f for x, f in pairs if x is not None and math.isfinite(x) and math.isfinite(f)]
        per_rung[str(rung)] = {
            "finished": len(xs),
            "spearman": _or_none(spearman_rho(xs, ys)),
            "kendall": _or_none(kendall_tau(xs, ys)),
        }
    close = 0
    for trial, rung in stopped.items():
        mine = _at(curves.get(trial, []), rung)
        there = [v for c in curves.values() if (v := _at(c, rung)) is not None and math.isfinite(v)]
        if mine is not None and there and sign * (mine - min(there, key=lambda v: sign * v)) <= margin:
            close += 1
    return {
        "noise": round(sigma, 5),
        "margin": round(margin, 5),
        "rungs": per_rung,
        "stopped": len(stopped),
        "stopped_within_noise": close,
    }
