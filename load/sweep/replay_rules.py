"""Replay candidate early-stopping rules on recorded grid curves (``record_grid.py``'s
``OUT/grid-cache``: an evaluation every 9 steps and a cooldown branch at 9, 27, 81) through the
bench's own scheduler (``run_asha`` with ``replayer``: no training), and print each rule's compute
ratio and regret per space, then the worst over the spaces.

    python load/sweep/replay_rules.py \\
        --space load/sweep/space-lr-beta2-ffn.yaml --records /tmp/rec/beta2/grid-cache \\
        --space load/sweep/space-lr-wd.yaml --records /tmp/rec/wd/grid-cache

A rule's rungs must lie on the records' evaluation cadence (and its cooldown rungs on theirs) to
replay faithfully. A bench run's own ``DIR/grid-cache`` (an evaluation every ``max_steps / 27``, no
branches) replays a space whose rungs judge the value (``rung_eval`` resolved to ``value``: every
schedule but ``wsd``). (RESULTS.md, 2026-12-06.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from forge_experiments.earlystop import Asha, AshaPromotion, Budgeted, Guarded
from forge_experiments.rungtrust import curve_noise
from forge_experiments.sweepspace import Space, parse
from forge_training.bench.sweep import ETA, Trial, _config, make_rule, replayer, run_asha, trust


@dataclasses.dataclass
class Projected(Budgeted):
    """Experimental (RESULTS.md, 2026-12-06, projection entry): rungs before the last keep at most
    ``cap`` trials (the rate front, then by deficit; 0: Guarded's ``n - n // eta``); the last
    rung finishes the ``finish`` trials best by :meth:`Budgeted.projected`."""

    cap: int = 0
    finish: int = 3

    def chosen(self, rung: int) -> set[str]:
        values = self.recorded[rung]
        if rung == self.rungs[-1]:
            return set(sorted(values, key=lambda t: (self.projected(t, rung), t))[: self.finish])
        ranked = sorted(values, key=lambda t: (self._key(values[t]), t))
        front = sorted(self.front(rung), key=lambda t: (self._key(values[t]), t))
        rest = sorted((t for t in ranked if t not in front), key=lambda t: (self.deficit(t, rung), t))
        keep = max(1, len(ranked) // self.eta)
        return set((front + rest)[: self.cap or max(keep, len(ranked) - keep)])


@dataclasses.dataclass
class NoiseBudget(Budgeted):
    """Experimental: the budgeted rule with a margin of 2·√2·σ, σ the :func:`curve_noise` of
    every trial's curve so far, in place of ``margin_k`` medians of the rung's deficits."""

    def margin(self, rung: int) -> float:
        return 2 * math.sqrt(2) * curve_noise(list(self.history.values()))


#: name → (rule, first rung, Guarded's settings)
CANDIDATES: dict[str, tuple[str, int, dict[str, Any]]] = {
    "asha-27": ("asha", 27, {}),
    "asha-9": ("asha", 9, {}),
    "budgeted": ("budgeted", 9, {}),  # the default (earlystop.Budgeted: deficit-budget-3 made a rule)
    "guarded": ("guarded", 9, {}),  # front + runners-up by deficit, one rate down at the last
    "guarded-value": ("guarded", 9, {"runners": "value"}),  # top third by value + front (before #42's fix)
    "guarded-front": ("guarded", 9, {"last": "front"}),  # the rate front at every rung
    "guarded-catchup": ("guarded", 9, {"last": "catchup"}),
    "guarded-none": ("guarded", 9, {"last": "none"}),  # top third only at the last rung
    # experimental (Projected, NoiseBudget): RESULTS.md, 2026-12-06, projection entry
    "projected-8": ("projected", 9, {}),
    "projected-10": ("projected", 9, {"cap": 10}),
    "noise-budget": ("noise-budget", 9, {}),
    # the budgeted rule at other margins (deficit-budget-3 is the default's)
    "deficit-budget-2": ("deficit-budget", 9, {"margin_k": 2.0}),
    "deficit-budget-3": ("deficit-budget", 9, {"margin_k": 3.0}),
    "deficit-budget-4": ("deficit-budget", 9, {"margin_k": 4.0}),
    "deficit-budget-6": ("deficit-budget", 9, {"margin_k": 6.0}),
}


Loaded = tuple[
    list[dict[str, Any]], dict[int, list[tuple[int, float]]], dict[int, dict[int, float]], list[float]
]


def load(space: Space, records: Path, partial: bool = False) -> Loaded:
    """The configurations, their curves, cooldown values by rung and finals, in the space's
    order, found by the resolved recipe's hash as the bench finds them, else (records with
    cooldown branches) by parameters (``partial``: only the configurations recorded so far; else
    a missing one is a KeyError)."""

    by_params: dict[str, dict[str, Any]] | None = None

    def record(index: int, params: dict[str, Any]) -> dict[str, Any] | None:
        # by the resolved recipe's hash, as the bench finds them (two spaces may share a trial);
        # records with cooldown branches (another recipe hash) by their parameters
        # (a space whose rungs judge after a branch needs the branch records: those first)
        nonlocal by_params
        if by_params is None:
            kept = [json.loads(p.read_text()) for p in sorted(records.glob("*.json"))]
            by_params = {json.dumps(r["params"], sort_keys=True): r for r in kept if r.get("rung_values")}
        branched = by_params.get(json.dumps(params, sort_keys=True))
        if branched is not None and space.early_stopping.rung_eval == "cooldown":
            return branched
        digest = _config(space, Trial(index, dict(params), None), False).recipe_hash()
        path = records / f"{digest}-{space.metric}.json"
        return json.loads(path.read_text()) if path.is_file() else branched

    found = [(p, record(i, p)) for i, p in enumerate(space.configurations())]
    missing = [p for p, r in found if r is None]
    if missing and not partial:
        raise KeyError(f"{space.name}: no record of {missing[0]} in {records}")
    configs = [p for p, r in found if r is not None]
    chosen = [r for _, r in found if r is not None]
    curves = {i: [(int(s), float(v)) for s, v in r["curve"]] for i, r in enumerate(chosen)}
    cooled = {i: {int(s): float(v) for s, v in r.get("rung_values", [])} for i, r in enumerate(chosen)}
    return configs, curves, cooled, [float(r["final"]) for r in chosen]


def replay(space: Space, records: Path, name: str, partial: bool = False) -> dict[str, Any]:
    rule_name, first, settings = CANDIDATES[name]
    configs, curves, cooled, finals = load(space, records, partial)
    es = dataclasses.replace(space.early_stopping, rule=rule_name, min_steps=first)
    variant = dataclasses.replace(space, early_stopping=es)
    mode = space.mode
    rule: Asha | AshaPromotion
    kinds = {
        "guarded": Guarded,
        "projected": Projected,
        "noise-budget": NoiseBudget,
        "deficit-budget": Budgeted,
    }
    if rule_name == "budgeted":
        rule = make_rule(variant, first)
    elif rule_name in kinds:
        es = dataclasses.replace(es, rule="guarded")
        variant = dataclasses.replace(space, early_stopping=es)
        if rule_name != "guarded":
            settings = {**settings, "branch": space.early_stopping.branch}
        rule = kinds[rule_name](min_steps=first, eta=ETA, max_steps=space.max_steps, mode=mode, **settings)  # type: ignore[arg-type]
    else:
        rule = AshaPromotion(min_steps=first, eta=ETA, max_steps=space.max_steps, mode=mode)  # type: ignore[arg-type]
    plan = [(p, None) for p in configs]
    trials, rule, resumed = run_asha(variant, plan, first, replayer(variant, curves, cooled), rule)
    sign = 1.0 if mode == "min" else -1.0
    done = [t for t in trials if t.final is not None]
    best = min(done, key=lambda t: sign * (t.final or 0.0))
    grid_best = min(finals, key=lambda v: sign * v)
    grid_steps = len(finals) * space.max_steps
    return {
        "space": space.name,
        "rule": name,
        "rung_eval": space.early_stopping.rung_eval,
        "rungs": rule.rungs,
        "compute_ratio": round(sum(t.steps for t in trials) / grid_steps, 3),
        "regret": round(sign * ((best.final or 0.0) - grid_best), 4),
        "best_trial": best.index,
        "finished": len(done),
        "rung_occupancy": rule.occupancy(),
        "resumed": resumed,
        "trust": trust(variant, trials, rule.rungs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--space", type=Path, action="append", required=True)
    parser.add_argument("--records", type=Path, action="append", required=True, help="grid-cache folders")
    parser.add_argument(
        "--rules", default=",".join(CANDIDATES), help="comma-separated, of: " + ", ".join(CANDIDATES)
    )
    parser.add_argument("--partial", action="store_true", help="replay the configurations recorded so far")
    args = parser.parse_args()
    if len(args.space) != len(args.records):
        parser.error("one --records per --space")
    worst: dict[str, dict[str, float]] = {}
    for path, records in zip(args.space, args.records, strict=True):
        space = parse(path.read_bytes())
        for name in args.rules.split(","):
            line = replay(space, records, name, args.partial)
            print(json.dumps(line), flush=True)
            w = worst.setdefault(name, {"regret": 0.0, "compute_ratio": 0.0})
            w["regret"] = max(w["regret"], line["regret"])
            w["compute_ratio"] = max(w["compute_ratio"], line["compute_ratio"])
    for name, w in worst.items():
        print(json.dumps({"worst": name, **w}), flush=True)


if __name__ == "__main__":
    main()
