"""Early-stopping rules of hyperparameter sweeps: the budgeted rule (the default), the guarded
rule it builds on, ASHA and median stopping. How far a sweep's rungs could be trusted is
:mod:`forge_experiments.rungtrust`.

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

**Guarded** (:class:`Guarded`, ``rule: guarded``): ASHA's promotion
form hedged against successive halving's short-horizon bias (a configuration that leads early,
typically a higher learning rate, is not the one that leads at the end of the schedule), so that
it needs no hand-picked first rung: its rungs are a 27th, a 9th and a third of the budget
(:func:`default_min_steps`). Nothing stops at the first rung (it is where the ranking is first
measured). Every later rung decides once it is complete (no trial can still reach it: none left
to start, none in flight below it, none promoted towards it), and a free worker is served from
the lowest rung that has a promotion (Algorithm 2 serves the highest), so each rung decides once,
on all its trials, and what it promotes does not depend on the order the trials arrived in.

A complete rung before the last promotes its *rate front* (each trial better there than every
trial of a lower, or its own, learning rate) and fills ASHA's other ``max(1, n // η) - 1``
places by *deficit* (how far a trial is behind the best other trial of no larger rate), at most
``n - n // η`` in all. The rationale: the best step size only falls as the horizon grows (Wu et
al. 2018, short-horizon bias; Bjorck et al. 2024, optimal rates across token horizons), so a
trial beaten by one of no larger rate will not overtake it by the full budget, while the best
trial of a lower rate than the leader's may. The same bias makes a value comparison *across*
rates at an early rung favour the higher rate, so ASHA's top third by value spends its places on
the second trials of the highest rates; measured against the trials of no larger rate, a trial's
deficit is free of its rate's early lead, and the places go to the runners-up least resolved from
a trial they could still overtake, whatever their rate (the other factor, β2 or width, has no
known horizon trend, so a small gap within a rate at an early rung settles nothing).
Without rates the deficit is the gap to the leader and the rule is ASHA on complete rungs. At the
last rung the hedge narrows to the leader and the front's next lower rate below the leader's,
ASHA's other places again by deficit among the trials off the front. The cap
``n - n // η`` (every deciding rung stops at least a third) and the
last rung's ``n // η + 1`` bound the trials run to the full budget: with 12 configurations, at
most 8 past the second rung and 3 to the end (0.47 of the grid's steps with the cooldown
branches of ``wsd``, 0.43 without).

**Budgeted** (:class:`Budgeted`, the default of a space's ``early_stopping``): the guarded
rule's rungs and completeness, with two changes that make it hold on spaces whose best
configuration leads late (measured in load/sweep/RESULTS.md):

- *Stop only what is clearly behind.* A complete rung before the last stops a trial only when
  its deficit (as the guarded rule measures it: behind the best other trial of no larger rate)
  exceeds ``margin_k`` times the median of the rung's non-negative deficits. The margin is
  scale-free: it is the typical gap between trials the rung cannot tell apart, so it adapts to
  the metric's units and to how far the configurations have spread at that budget; a fixed share
  (ASHA's ``n // eta``) stops the late leader whenever it is a few places down early on.
- *Spend what is left on the likeliest finishers.* The last rung finishes as many trials as keep
  the sweep within ``budget`` of the grid's trial-steps (every configuration at ``max_steps``),
  counting every step already spent, each rung's cooldown branch (``ceil(branch × rung)`` steps,
  ``branch`` the space's ``cooldown_fraction`` when its rungs judge after a branch) and a paused
  trial's one extra step, and at least one. They are ranked by the value projected to
  ``max_steps``, straight in log step through the trial's values at the rung before and this one:
  a trial still gaining on the leader ranks above one that has flattened out.

With 12 configurations under defaults (rungs a 27th, a 9th and a third of the budget, ``budget``
0.5) the sweep costs at most half the grid's trial-steps whatever the margin keeps, since the last
rung's finishers are counted from what the earlier ones spent.

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


@dataclass
class Guarded(AshaPromotion):
    """ASHA's promotion form hedged against its short-horizon bias (see the module docstring).

    - The first rung promotes every trial at once: it is where the ranking is first measured.
    - Every later rung decides only once it is complete (no trial can still reach it:
      ``next_promotion``'s ``final_below`` and :meth:`arriving`), lower rungs first, so what it
      promotes depends on the values there, not on the order in which the trials arrived.
    - A complete rung before the last promotes its *rate front*: every trial that beats all
      trials of a lower learning rate (and its own rate's others) there. The optimal step size
      only falls as the horizon grows (the short-horizon bias: Wu et al. 2018; Bjorck et al.
      2024), so a trial beaten at a rung by one of no larger rate will not overtake it, while
      one ahead of every lower rate may still be the best at the full budget. ASHA's other
      ``max(1, n // eta) - 1`` places go by :meth:`deficit` (``runners``), at most
      ``n - n // eta`` trials in all (see the module docstring for why). Trials of no known
      rate (:meth:`describe`) form one group: the rule is then ASHA on complete rungs.
    - ``last``: what the last rung adds to its top ``max(1, n // eta)``: ``front`` (the rate
      front, as earlier rungs), ``next`` (the best trial of the next lower rate than the
      leader's: one step down the front), ``catchup`` (front members whose gap to the leader,
      less the ground they gained on it since the rung before per unit of log step carried on
      to ``max_steps``, is not positive) or ``none``.
    """

    rate_key: str = "optim.lr"
    """The parameter that sets the step size (a trial's value of it: :meth:`describe`)."""
    last: Literal["front", "next", "catchup", "none"] = "next"
    runners: Literal["deficit", "value"] = "deficit"
    """How a rung fills ASHA's ``max(1, n // eta)`` places past the leader: ``deficit`` (the
    trials off the front least behind a trial of no larger rate; before the last rung the front
    first and at most ``n - n // eta`` in all) or ``value`` (the best overall)."""
    rates: dict[str, float] = field(default_factory=dict)
    """Trial → its learning rate (trials with none are one group)."""
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """Trial → (step, value) of every judged evaluation it reported, in step order."""

    def describe(self, trial: str, params: dict[str, Any]) -> None:
        """Record a trial's parameters (before it reports): its rate, if it has one."""
        rate = params.get(self.rate_key)
        if isinstance(rate, int | float) and not isinstance(rate, bool) and math.isfinite(rate):
            self.rates[trial] = float(rate)

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

    def _key(self, value: float) -> float:
        return value if self.mode == "min" else -value

    def front(self, rung: int) -> list[str]:
        """The rung's rate front: trials better there than every trial of a lower rate and
        than the others of their own rate (ties: the earlier-named trial), lowest rate first."""
        values = self.recorded[rung]
        by_rate = sorted(values, key=lambda t: (self.rates.get(t, math.inf), self._key(values[t]), t))
        out: list[str] = []
        best = math.inf
        for trial in by_rate:
            if self._key(values[trial]) < best:
                out.append(trial)
                best = self._key(values[trial])
        return out

    def _catching_up(self, trial: str, leader: str, rung: int) -> bool:
        """Is ``trial``'s projected gap to ``leader`` at ``max_steps`` not positive?"""
        index = self.rungs.index(rung)
        values = self.recorded[rung]
        gap = self._key(values[trial]) - self._key(values[leader])
        if index == 0 or not math.isfinite(gap):
            return False
        before = self.rungs[index - 1]
        mine, theirs = self._value_at(trial, before), self._value_at(leader, before)
        if mine is None or theirs is None or not math.isfinite(self._key(mine) - self._key(theirs)):
            return False
        closed = self._key(mine) - self._key(theirs) - gap  # > 0: it gained on the leader
        per_log = closed / math.log(rung / before)
        return gap - max(0.0, per_log) * math.log(self.max_steps / rung) <= 0.0

    def _value_at(self, trial: str, step: int) -> float | None:
        for s, v in self.history.get(trial, []):
            if s == step:
                return v
        return None

    def deficit(self, trial: str, rung: int) -> float:
        """How far ``trial`` is behind, at ``rung``, the best other trial of no larger rate (below
        zero: ahead of them all, a front member; -inf: no such trial). With no rates: the gap
        to the best other trial."""
        values = self.recorded[rung]
        rate = self.rates.get(trial, math.inf)
        others = [
            self._key(v) for t, v in values.items() if t != trial and self.rates.get(t, math.inf) <= rate
        ]
        return self._key(values[trial]) - min(others) if others else -math.inf

    def chosen(self, rung: int) -> set[str]:
        """What the complete ``rung`` promotes (see the class docstring)."""
        values = self.recorded[rung]
        ranked = sorted(values, key=lambda t: (self._key(values[t]), t))
        if not ranked:
            return set()
        keep = max(1, len(ranked) // self.eta)
        out = set(ranked[:keep])
        front = self.front(rung)
        if self.runners == "deficit":
            rest = sorted((t for t in ranked if t not in front), key=lambda t: (self.deficit(t, rung), t))
            if rung != self.rungs[-1]:
                by_value = sorted(front, key=lambda t: (self._key(values[t]), t))
                return set((by_value + rest[: keep - 1])[: max(keep, len(ranked) - keep)])
            out = {ranked[0], *rest[: keep - 1]}
        if rung != self.rungs[-1] or self.last == "front":
            return out | set(front)
        leader = ranked[0]
        below = [
            t for t in front if t != leader and self.rates.get(t, math.inf) < self.rates.get(leader, math.inf)
        ]
        if self.last == "next" and below:
            out.add(below[-1])
        elif self.last == "catchup":
            out |= {t for t in below if self._catching_up(t, leader, rung)}
        return out

    def next_promotion(self, final_below: int = 0) -> tuple[str, int] | None:
        """The paused trial to resume and the rung it leaves, the *lowest* rung with one first
        (ASHA's Algorithm 2 serves the highest: a rung that decides once must wait for every
        trial a lower rung still promotes, or it decides on part of its trials and again when
        the rest arrive, and promotes the union). A rung is complete when it is at or below
        ``final_below`` (none left to start, none in flight below it: the caller's view) and no
        trial is on its way to it (:meth:`arriving`): a trial the rule promoted counts as on its
        way whether or not the caller has started it yet."""
        for rung in self.rungs:
            found = self._candidates(rung, final=rung <= final_below and not self.arriving(rung))
            if found:
                self.promoted[rung].append(found[0])
                return found[0], rung
        return None

    def arriving(self, rung: int) -> bool:
        """Can a trial still reach ``rung`` from below: one promoted out of a lower rung and not
        yet recorded at the rung above that one?"""
        for lower, upper in zip(self.rungs, self.rungs[1:], strict=False):
            if upper > rung:
                break
            if any(t not in self.recorded[upper] for t in self.promoted[lower]):
                return True
        return False

    def _candidates(self, rung: int, final: bool) -> list[str]:
        values = self.recorded[rung]
        if rung == self.rungs[0]:
            chosen = set(values)
        elif not final:
            return []  # a rung decides once complete: no arrival order matters
        else:
            chosen = self.chosen(rung)
        ranked = sorted(chosen, key=lambda t: (self._key(values[t]), t))
        return [t for t in ranked if t not in self.promoted[rung]]


@dataclass
class Budgeted(Guarded):
    """The guarded rule with a scale-free stopping margin and budgeted finishers (see the module
    docstring): rungs before the last keep every trial whose :meth:`deficit` is within
    :meth:`margin`; the last finishes the :meth:`finishers` best by :meth:`projected`."""

    budget: float = 0.5
    """The sweep's trial-steps as a share of the grid's (every trial at ``max_steps``)."""
    margin_k: float = 3.0
    """The margin in medians of the rung's non-negative deficits."""
    branch: float = 0.0
    """Each rung's cooldown branch as a share of the rung (0: rungs judge the value as reported)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.budget <= 1.0 or not self.margin_k > 0.0 or not 0.0 <= self.branch <= 1.0:
            raise ValueError("budget in (0, 1], margin_k > 0 and branch in [0, 1] are required")

    def margin(self, rung: int) -> float:
        """``margin_k`` times the median of the rung's non-negative, finite deficits (inf: none)."""
        gaps = [d for d in (self.deficit(t, rung) for t in self.recorded[rung]) if 0.0 <= d < math.inf]
        return self.margin_k * statistics.median(gaps) if gaps else math.inf

    def projected(self, trial: str, rung: int) -> float:
        """The trial's value (lower is better) at ``max_steps``, straight in log step through its
        values at the rung before and ``rung`` (its value at ``rung`` when there is no earlier one)."""
        value = self._key(self.recorded[rung][trial])
        index = self.rungs.index(rung)
        before = self._value_at(trial, self.rungs[index - 1]) if index else None
        if before is None or not math.isfinite(value) or not math.isfinite(self._key(before)):
            return value
        slope = (value - self._key(before)) / math.log(rung / self.rungs[index - 1])
        return value + slope * math.log(self.max_steps / rung)

    def spent(self) -> int:
        """Trial-steps spent so far: each trial's highest rung reached, plus the step it paused at
        and the cooldown branches of the rungs it reached."""
        total = 0
        for trial in self.recorded[self.rungs[0]]:
            reached = [r for r in self.rungs if trial in self.recorded[r]]
            total += max(reached) + 1 + sum(math.ceil(self.branch * r) for r in reached)
        return total

    def finishers(self, rung: int) -> int:
        """How many trials the last ``rung`` can finish within the budget (at least one)."""
        left = self.budget * len(self.recorded[self.rungs[0]]) * self.max_steps - self.spent()
        return max(1, int(left // (self.max_steps - rung)))

    def chosen(self, rung: int) -> set[str]:
        values = self.recorded[rung]
        if rung != self.rungs[-1]:
            margin = self.margin(rung)
            return {t for t in values if self.deficit(t, rung) <= margin}
        ranked = sorted(values, key=lambda t: (self.projected(t, rung), t))
        return set(ranked[: self.finishers(rung)])


Rule = Asha | AshaPromotion | Guarded | Budgeted | MedianStopping


def build(
    rule: str,
    min_steps: int,
    eta: int,
    max_steps: int,
    mode: str = "min",
    form: str = "promotion",
    min_trials: int = 3,
    branch: float = 0.0,
) -> Rule | None:
    """The rule a space's ``early_stopping`` names (``budgeted``, ``guarded``, ``asha`` in its
    ``form``, ``median``; None for ``none``). ``branch``: each rung's cooldown branch as a share of
    the rung, which the budgeted rule counts against its budget."""
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be min or max, not {mode!r}")
    sense: Mode = "min" if mode == "min" else "max"
    if rule == "budgeted":
        return Budgeted(min_steps, eta, max_steps, sense, branch=branch)
    if rule == "guarded":
        return Guarded(min_steps, eta, max_steps, sense)
    if rule == "asha":
        return (
            AshaPromotion(min_steps, eta, max_steps, sense)
            if form == "promotion"
            else Asha(min_steps, eta, max_steps, sense)
        )
    if rule == "median":
        return MedianStopping(min_steps, min_trials, sense)
    if rule == "none":
        return None
    raise ValueError(f"unknown early-stopping rule {rule!r}")
