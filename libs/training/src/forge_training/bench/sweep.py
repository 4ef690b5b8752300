"""``forge bench sweep --space FILE --out DIR``: the same space run twice, every configuration at
full budget (grid) and under early stopping (η = 3: the space's rule, ``guarded`` or ASHA; the
summary's ``asha`` key names this side whatever the rule), in-process. Several spaces and drawn
ones: :mod:`forge_training.bench.sweep_cli`.

Writes ``DIR/summary.json``::

    {"space", "recipe", "metric", "mode", "eta", "rule", "form", "rung_eval", "cooldown_fraction",
     "rungs", "max_steps",
     "trust",           # forge_experiments.rungtrust.rung_trust of the early-stopping side's trials
     "grid": {"best_metric", "best_trial", "trial_steps", "wall_s", "reused"},
     "asha": {"best_metric", "best_trial", "trial_steps", "branch_steps", "stopped_early", "resumed",
              "rung_occupancy", "concurrency", "wall_s"},
     "compute_ratio",   # asha trial-steps / grid trial-steps
     "regret",          # asha best - grid best (min mode; grid best - asha best for max), metric units
     "per_trial": [{"run", "trial", "params", "seed", "steps", "final", "stopped_at", "curve",
                    "branch_steps", "rung_values"}]}

Under ``early_stopping.rung_eval: cooldown`` the ASHA trials take a cooldown branch at each rung
(:mod:`forge_training.cooldown`) and the rule judges the rungs on the branches' values
(``rung_values``); a trial's ``steps`` include its branches' (``branch_steps``). The grid's trials
take none. A grid trial's record (steps, final value, curve) is kept in ``DIR/grid-cache`` under
the hash of its resolved recipe and the metric, and a later run over a space with that trial
reads it instead of training it again (``grid.reused``; ``--fresh-grid`` trains every one):
the record holds as long as the training code and data are those that made it.

Trials are the space's configurations (:meth:`Space.configurations`) times its seeds (or the
recipe's seed). The grid runs them one after another, in order. ASHA runs them as the sweep
workflow does: up to the space's ``concurrency`` trials in flight, new ones taken in an order
shuffled with the space's seed, advanced in lockstep (:func:`run_interleaved`: each in-flight
trial in turn runs to its next evaluation, so trials reach a rung at about the time parallel
workers would), and judged by the rule the sweep workflow uses (:mod:`forge_experiments.earlystop`, the
space's ``early_stopping.form``) on the metric as the run writes it to ``metrics.jsonl``, in the
order they report. Promotion form (the default): a trial at a rung pauses (it stops at its next
step, saving its checkpoint, as a cancelled job does) unless promotable at once; a free slot
first resumes the best promotable paused trial from its checkpoint, then starts a new one.
Stopping form: a trial judged out stops for good. ASHA's best is the best final metric of the
trials that reached the full budget. Rungs start at ``early_stopping.min_steps`` of the space
(the grace period; ``max_steps / 27`` when the space has no ASHA rule).
"""

from __future__ import annotations

import json
import math
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from forge_experiments.earlystop import Asha, AshaPromotion, Guarded, build
from forge_experiments.rungtrust import rung_trust
from forge_experiments.sweepspace import COOLDOWN_PREFIX, RUNG_RULES, Space
from forge_kit.objectstore import ObjectStore
from forge_training import cooldown, recipes, schema, validation
from forge_training.train import RunContext
from forge_training.train import train as run_training

ETA = 3


@dataclass
class Trial:
    index: int
    params: dict[str, Any]
    seed: int | None
    steps: int = 0
    """Optimizer steps the trial cost: its own and its cooldown branches'."""
    final: float | None = None
    stopped_at: int | None = None
    curve: list[tuple[int, float]] = field(default_factory=list)
    branch_steps: int = 0
    rung_values: list[tuple[int, float]] = field(default_factory=list)
    """The metric after each cooldown branch (``rung_eval: cooldown``)."""


class _MetricTail:
    """Reads new lines of a run's ``metrics.jsonl`` as the run appends them: (step, the metric or
    None, its cooldown value or None) for each line with either."""

    def __init__(self, path: Path, metric: str) -> None:
        self._path, self._metric, self._offset = path, metric, 0
        self._cooled = COOLDOWN_PREFIX + metric

    def new(self) -> list[tuple[int, float | None, float | None]]:
        if not self._path.exists():
            return []
        with self._path.open("rb") as f:
            f.seek(self._offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1
        self._offset += end
        out: list[tuple[int, float | None, float | None]] = []
        for line in chunk[:end].splitlines():
            row = json.loads(line)
            plain, cooled = row.get(self._metric), row.get(self._cooled)
            if plain is not None or cooled is not None:
                out.append(
                    (
                        int(row["step"]),
                        None if plain is None else float(plain),
                        None if cooled is None else float(cooled),
                    )
                )
        return out


def _config(space: Space, trial: Trial, branches: bool = True) -> schema.TrainConfig:
    overrides = space.trial_overrides(trial.params, trial.seed, branches=branches)
    config = recipes.build(space.recipe, overrides)
    validation.validate(config, 1)
    return config


def run_trial(
    space: Space,
    trial: Trial,
    root: Path,
    cache: Path,
    judge: Callable[[int, float | None], bool] | None = None,
) -> None:
    """Train one trial; ``judge(step, value)`` → False stops it (at its next step). ``value`` is
    what the rule compares at ``step`` (the metric, or under ``rung_eval: cooldown`` its value
    after the rung's branch), or None at an evaluation the rule does not judge."""
    cooled_rungs = space.early_stopping.rung_eval == "cooldown" and judge is not None
    run_dir = root / f"t{trial.index:03d}"
    tail = _MetricTail(run_dir / "metrics.jsonl", space.metric)
    stop = {"now": False}

    def should_stop() -> bool:
        for step, plain, cooled in tail.new():
            if plain is not None:
                if trial.curve and step <= trial.curve[-1][0]:
                    continue  # a resumed trial's earlier lines
                trial.curve.append((step, plain))
            if cooled is not None:
                if trial.rung_values and step <= trial.rung_values[-1][0]:
                    continue
                trial.rung_values.append((step, cooled))
            value = cooled if cooled_rungs else plain
            if cooled_rungs and cooled is None and step in space.rungs():
                continue  # the branch's line follows; the rule judges that
            if judge is not None and not stop["now"] and not judge(step, value):
                stop["now"] = True
                trial.stopped_at = step
        return stop["now"]

    ctx = RunContext(
        run_id=f"t{trial.index}",
        run_dir=run_dir,
        store=ObjectStore(str(run_dir / "objects")),
        cache_dir=cache,
        should_stop=should_stop,
        export=False,
    )
    result = run_training(_config(space, trial, branches=judge is not None), ctx)
    should_stop()  # the final evaluation's line
    trial.branch_steps += result.branch_steps
    trial.steps = result.step + trial.branch_steps
    if result.outcome == "succeeded" and result.step >= space.max_steps:
        trial.final = result.eval_metrics.get(space.metric, trial.curve[-1][1] if trial.curve else None)


Judge = Callable[[int, float | None], bool]
RunOne = Callable[[Trial, Judge], None]
Rule = Callable[[int, int, float], bool]


class _Turns:
    """One baton among the in-flight trials' threads: only its holder runs, so the interleaving is
    the scheduler's alone (deterministic). The process-wide RNGs travel with the baton: a trial's
    random draws are the ones it would make alone."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.turn: int | None = None
        self.finished: set[int] = set()

    def wait(self, index: int) -> None:
        with self.cv:
            self.cv.wait_for(lambda: self.turn == index)

    def release(self, index: int, finished: bool = False) -> None:
        with self.cv:
            if finished:
                self.finished.add(index)
            self.turn = None
            self.cv.notify_all()

    def pause(self, index: int) -> None:
        """Hand the baton back to the scheduler and wait for the next turn."""
        rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())
        self.release(index)
        self.wait(index)
        torch.set_rng_state(rng[0])
        random.setstate(rng[1])
        np.random.set_state(rng[2])

    def give(self, index: int) -> None:
        """The scheduler's side: let ``index`` run until it pauses or finishes."""
        with self.cv:
            self.turn = index
            self.cv.notify_all()
            self.cv.wait_for(lambda: self.turn is None)


def run_interleaved(
    next_job: Callable[[list[Trial]], Trial | None], concurrency: int, judge: Rule | None, run_one: RunOne
) -> None:
    """Run trials with up to ``concurrency`` in flight, round-robin: each in-flight trial in turn
    runs until its next metric value, which goes to ``judge(trial.index, step, value)`` (False
    stops it), then waits for the others. A free slot asks ``next_job(in_flight)`` for the next
    trial to run (a new one, or a paused one to resume; None: nothing now); the run ends when
    nothing is in flight and ``next_job`` has nothing. ``run_one(trial, on_value)`` trains one
    trial (resuming it from its checkpoint when it ran before), calling ``on_value(step, value)``
    for each evaluation (``value`` None where the rule judges nothing: a turn all the same) and
    stopping when it returns False."""
    turns = _Turns()
    errors: list[BaseException] = []

    def work(trial: Trial) -> None:
        turns.wait(trial.index)

        def on_value(step: int, value: float | None) -> bool:
            go = judge is None or value is None or judge(trial.index, step, value)
            if go:
                turns.pause(trial.index)
            return go

        try:
            run_one(trial, on_value)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the scheduler
            errors.append(exc)
        finally:
            turns.release(trial.index, finished=True)

    inflight: list[tuple[Trial, threading.Thread]] = []
    while True:
        while len(inflight) < concurrency:
            trial = next_job([t for t, _ in inflight])
            if trial is None:
                break
            turns.finished.discard(trial.index)
            thread = threading.Thread(target=work, args=(trial,), name=f"trial-{trial.index}", daemon=True)
            thread.start()
            inflight.append((trial, thread))
        if not inflight:
            return
        for trial, thread in list(inflight):
            turns.give(trial.index)
            if trial.index in turns.finished:
                thread.join()
                inflight.remove((trial, thread))
        if errors:
            raise errors[0]


def in_order(trials: list[Trial]) -> Callable[[list[Trial]], Trial | None]:
    """A ``next_job`` for :func:`run_interleaved` that starts ``trials`` in list order, once each."""
    queue = deque(trials)
    return lambda _inflight: queue.popleft() if queue else None


def _best(space: Space, trials: list[Trial]) -> Trial | None:
    done = [t for t in trials if t.final is not None]
    if not done:
        return None
    pick = min if space.mode == "min" else max
    return pick(done, key=lambda t: t.final if t.final is not None else 0.0)


def replayer(
    space: Space,
    curves: dict[int, list[tuple[int, float]]],
    rung_values: dict[int, dict[int, float]] | None = None,
) -> RunOne:
    """A ``run_one`` for :func:`run_asha` that replays recorded values instead of training: trial
    ``i`` reports ``curves[i]`` (its metric by step, up to ``max_steps``) and, under ``rung_eval:
    cooldown``, ``rung_values[i][rung]`` after each rung, whose branch costs the steps the trainer
    would take (:func:`forge_training.cooldown.branch_steps`). A paused or stopped trial costs one
    step more, as a trained one does (it stops at its next step); a resumed one goes on from there."""
    cooled = space.early_stopping.rung_eval == "cooldown"

    def run_one(trial: Trial, on_value: Judge) -> None:
        config = recipes.build(space.recipe, space.trial_overrides(trial.params, trial.seed))
        branches = cooldown.branch_steps(config) if cooled else {}
        done = trial.curve[-1][0] if trial.curve else 0  # a resumed trial's last report
        for step, value in curves[trial.index]:
            if step <= done:
                continue
            trial.curve.append((step, value))
            judged: float | None = value
            if step in branches:
                trial.branch_steps += branches[step]
                judged = (rung_values or {}).get(trial.index, {}).get(step)
                trial.rung_values.append((step, judged if judged is not None else math.nan))
            elif cooled:
                judged = None
            if step < space.max_steps and not on_value(step, judged):
                trial.stopped_at, trial.steps = step, step + 1 + trial.branch_steps
                return
        trial.steps = space.max_steps + trial.branch_steps
        trial.final = trial.curve[-1][1] if trial.curve and trial.curve[-1][0] == space.max_steps else None

    return run_one


def trust(space: Space, trials: Sequence[Trial], rungs: list[int]) -> dict[str, Any]:
    """:func:`forge_experiments.rungtrust.rung_trust` of the early-stopping side's trials, on the values
    its rule judged (the cooldown branches' under ``rung_eval: cooldown``)."""
    cooled = space.early_stopping.rung_eval == "cooldown"
    return rung_trust(
        {str(t.index): list(t.rung_values if cooled else t.curve) for t in trials},
        {str(t.index): t.final for t in trials if t.final is not None},
        {str(t.index): t.stopped_at for t in trials if t.final is None and t.stopped_at is not None},
        rungs,
        space.mode,  # type: ignore[arg-type]
    )


def make_rule(space: Space, min_steps: int) -> Asha | AshaPromotion:
    """The rule the space names (η = :data:`ETA`, rungs from ``min_steps``,
    :func:`forge_experiments.earlystop.build`); a space with no rung rule: ASHA, promotion form."""
    es = space.early_stopping
    rule = build(
        es.rule if es.rule in RUNG_RULES else "asha",
        min_steps,
        ETA,
        space.max_steps,
        space.mode,
        es.form,
        branch=es.branch,
    )
    if not isinstance(rule, Asha | AshaPromotion):  # build gives a rung rule for every rung rule name
        raise TypeError(f"{es.rule!r} is not a rule that judges at rungs")
    return rule


def run_asha(
    space: Space,
    plan: Sequence[tuple[Mapping[str, Any], int | None]],
    min_steps: int,
    run_one: RunOne,
    rule: Asha | AshaPromotion | None = None,
) -> tuple[list[Trial], Asha | AshaPromotion, int]:
    """The early-stopping side (``rule``, by default :func:`make_rule`'s for the space) over
    ``plan`` (the trials' parameters and seeds), new trials taken in an order shuffled with the
    space's seed, ``space.concurrency`` in flight (:func:`run_interleaved`); ``run_one`` trains (or
    replays) one trial. Returns the trials (in that order), the rule, and the number of
    resumptions."""
    asha_rule = rule if rule is not None else make_rule(space, min_steps)
    order = list(range(len(plan)))
    random.Random(space.seed).shuffle(order)
    asha = [Trial(i, dict(plan[i][0]), plan[i][1]) for i in order]
    if isinstance(asha_rule, Guarded):
        for trial in asha:
            asha_rule.describe(str(trial.index), trial.params)
    by_index = {t.index: t for t in asha}
    fresh = deque(asha)
    resumed = [0]

    def judge(index: int, step: int, value: float) -> bool:
        return asha_rule.report(str(index), step, value) not in ("pause", "stop")

    def next_job(inflight: list[Trial]) -> Trial | None:
        if not isinstance(asha_rule, AshaPromotion):  # the stopping form: new trials only
            return fresh.popleft() if fresh else None
        # Rungs no trial can still reach (none left to start, none in flight below) are final.
        final_below = 0
        if not fresh:
            reached = [asha_rule.reached(str(t.index)) for t in inflight]
            final_below = min([*reached, space.max_steps])
        promoted = asha_rule.next_promotion(final_below)
        if promoted is not None:
            trial = by_index[int(promoted[0])]
            trial.stopped_at = None
            resumed[0] += 1
            return trial
        return fresh.popleft() if fresh else None

    run_interleaved(next_job, space.concurrency, judge, run_one)
    return asha, asha_rule, resumed[0]


def grid_trials(
    space: Space,
    plan: Sequence[tuple[Mapping[str, Any], int | None]],
    work: Path,
    cache: Path,
    grid_cache: Path | None,
    echo: Callable[[str], None] = print,
    reverse: bool = False,
) -> tuple[list[Trial], int]:
    """Every trial of ``plan`` at the full budget, one after another; a trial with a record in
    ``grid_cache`` (by the hash of its resolved recipe and the metric) is read, not trained, and
    a trained one's record is written there (``reverse``: the last trial first, so that a second
    process can share one grid's records). Returns the trials and how many were read."""
    grid = [Trial(i, dict(p), s) for i, (p, s) in enumerate(plan)]
    reused = 0
    for trial in reversed(grid) if reverse else grid:
        echo(f"grid trial {trial.index + 1}/{len(grid)}")
        record = (
            None
            if grid_cache is None
            else grid_cache / f"{_config(space, trial, False).recipe_hash()}-{space.metric}.json"
        )
        if record is not None and record.is_file():
            kept = json.loads(record.read_text())
            trial.steps, trial.final = int(kept["steps"]), kept["final"]
            trial.curve = [(int(s), float(v)) for s, v in kept["curve"]]
            trial.rung_values = [(int(s), float(v)) for s, v in kept.get("rung_values", [])]
            reused += 1
            continue
        run_trial(space, trial, work / "grid", cache)
        if record is not None and trial.final is not None:
            record.parent.mkdir(parents=True, exist_ok=True)
            kept_now = {
                "steps": trial.steps,
                "final": trial.final,
                "curve": trial.curve,
                "rung_values": trial.rung_values,
            }
            # another process may share the folder (record_grid.py --reverse, --jobs): a reader
            # sees the whole record or none
            partial = record.with_name(f".{record.name}.{os.getpid()}")
            partial.write_text(json.dumps({"params": trial.params, "seed": trial.seed, **kept_now}))
            partial.replace(record)
    return grid, reused


def benchmark(
    space: Space,
    work: Path,
    cache: Path,
    echo: Callable[[str], None] = print,
    grid_cache: Path | None = None,
    run_grid: bool = True,
) -> dict[str, Any]:
    """Run the grid, then ASHA, over the same trials; the summary (see the module docstring).
    ``echo`` hears one line as each trial begins (a progress display's stage name).
    ``grid_cache``: a folder of grid trials' records (steps, final value, curve) by the hash of
    the trial's resolved recipe; a trial with a record there is not trained again.
    ``run_grid`` False: ASHA only; ``grid`` then says so, ``compute_ratio`` divides by the steps
    of every trial at the full budget and ``regret`` is None."""
    seeds: list[int | None] = list(space.seeds) or [None]
    configs = space.configurations()
    plan = [(params, seed) for params in configs for seed in seeds]
    min_steps = space.early_stopping.min_steps if space.early_stopping.rule in RUNG_RULES else 0
    min_steps = min_steps or max(1, space.max_steps // ETA**3)
    # 1. Grid: every trial at full budget (or its record from an earlier run of the same config).
    started = time.perf_counter()
    grid, reused = grid_trials(space, plan, work, cache, grid_cache, echo) if run_grid else ([], 0)
    grid_wall = time.perf_counter() - started
    # 2. ASHA, the same trials in a shuffled arrival order.
    runs = iter(range(1, 10**9))

    def run_one(trial: Trial, on_value: Judge) -> None:
        echo(f"asha run {next(runs)} (trial {trial.index})")
        run_trial(space, trial, work / "asha", cache, on_value)

    started = time.perf_counter()
    asha, asha_rule, resumed = run_asha(space, plan, min_steps, run_one)
    asha_wall = time.perf_counter() - started
    grid_best, asha_best = _best(space, grid), _best(space, asha)
    if (
        (run_grid and (grid_best is None or grid_best.final is None))
        or asha_best is None
        or asha_best.final is None
    ):
        raise RuntimeError("no trial finished: nothing to compare")
    grid_steps = sum(t.steps for t in grid) if run_grid else len(plan) * space.max_steps
    asha_steps = sum(t.steps for t in asha)
    sign = 1.0 if space.mode == "min" else -1.0
    rows = [
        {
            "run": run,
            "trial": t.index,
            "params": t.params,
            "seed": t.seed,
            "steps": t.steps,
            "final": t.final,
            "stopped_at": t.stopped_at,
            "curve": t.curve,
            "branch_steps": t.branch_steps,
            "rung_values": t.rung_values,
        }
        for run, trials in (("grid", grid), ("asha", asha))
        for t in trials
    ]
    return {
        "space": space.name,
        "recipe": space.recipe,
        "metric": space.metric,
        "mode": space.mode,
        "eta": ETA,
        "rule": space.early_stopping.rule if space.early_stopping.rule in RUNG_RULES else "asha",
        "form": space.early_stopping.form,
        "rung_eval": space.early_stopping.rung_eval,
        "cooldown_fraction": space.early_stopping.cooldown_fraction
        if space.early_stopping.rung_eval == "cooldown"
        else None,
        "rungs": asha_rule.rungs,
        "max_steps": space.max_steps,
        "grid": {
            "best_metric": grid_best.final,
            "best_trial": grid_best.index,
            "trial_steps": grid_steps,
            "wall_s": round(grid_wall, 1),
            "reused": reused,
        }
        if grid_best is not None
        else {"skipped": True, "trial_steps": grid_steps},
        "asha": {
            "best_metric": asha_best.final,
            "best_trial": asha_best.index,
            "trial_steps": asha_steps,
            "branch_steps": sum(t.branch_steps for t in asha),
            "stopped_early": sum(1 for t in asha if t.final is None),
            "resumed": resumed,
            "rung_occupancy": asha_rule.occupancy(),
            "concurrency": space.concurrency,
            "wall_s": round(asha_wall, 1),
        },
        "trust": trust(space, asha, asha_rule.rungs),
        "compute_ratio": asha_steps / grid_steps,
        "regret": sign * (asha_best.final - grid_best.final)
        if grid_best and grid_best.final is not None
        else None,
        "per_trial": rows,
    }
