"""Regret of an ``--asha-only`` run against grid records trained apart (``DIR/grid-cache`` of a
bench run, or of ``record_grid.py --eval-every E --cooldown 0`` with ``E`` the space's first rung:
the same recipe hashes as the bench's grid trials; records with cooldown branches, ``record_grid.py
--cooldown``, by their parameters: a branch leaves the trial's path unchanged). Prints, as JSON: the early-stopping side's
figures, how many of the grid's trials have a record, the best of those, the regret against it,
and whether every trial the early-stopping side finished ended at its grid record's value.

    python load/sweep/regret_from_records.py --space load/sweep/space-lr-wd.yaml \\
        --summary /tmp/a/spaces/tiny-lr-wd-wsd/summary.json --grid-cache /tmp/g/grid-cache

(RESULTS.md, 2026-12-06, real bench runs.)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from forge_experiments.sweepspace import parse
from forge_training.bench.sweep import Trial, _config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--space", type=Path, required=True)
    parser.add_argument("--summary", type=Path, required=True, help="the --asha-only run's summary.json")
    parser.add_argument("--grid-cache", type=Path, action="append", required=True, help="repeatable")
    args = parser.parse_args()
    space = parse(args.space.read_bytes())
    summary = json.loads(args.summary.read_text())
    seeds: list[int | None] = list(space.seeds) or [None]
    plan = [(p, s) for p in space.configurations() for s in seeds]
    grid: dict[int, float] = {}
    by_params = {
        (json.dumps(r["params"], sort_keys=True), r.get("seed")): float(r["final"])
        for d in args.grid_cache
        for r in (json.loads(f.read_text()) for f in sorted(d.glob("*.json")))
        if r.get("rung_values") and r.get("final") is not None
    }
    for index, (params, seed) in enumerate(plan):
        name = f"{_config(space, Trial(index, dict(params), seed), False).recipe_hash()}-{space.metric}.json"
        found = [d / name for d in args.grid_cache if (d / name).is_file()]
        if found:
            grid[index] = float(json.loads(found[0].read_text())["final"])
        elif (branched := by_params.get((json.dumps(params, sort_keys=True), seed))) is not None:
            grid[index] = branched  # a record with cooldown branches (another recipe hash): same final
    asha = [r for r in summary["per_trial"] if r["run"] == "asha"]
    finished = {r["trial"]: r["final"] for r in asha if r["final"] is not None}
    sign = 1.0 if space.mode == "min" else -1.0
    best = min(grid, key=lambda i: sign * grid[i]) if grid else None
    out = {
        "space": space.name,
        "compute_ratio": summary["compute_ratio"],
        "asha_trial_steps": summary["asha"]["trial_steps"],
        "asha_best": {"trial": summary["asha"]["best_trial"], "final": summary["asha"]["best_metric"]},
        "grid_records": f"{len(grid)} of {len(plan)}",
        "grid_best_of_records": None if best is None else {"trial": best, "final": grid[best]},
        "regret_vs_records": None if best is None else sign * (summary["asha"]["best_metric"] - grid[best]),
        "finished_match_grid": {str(i): (grid.get(i), v, grid.get(i) == v) for i, v in finished.items()},
        "params": {str(i): dict(p) for i, (p, _) in enumerate(plan)},
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
