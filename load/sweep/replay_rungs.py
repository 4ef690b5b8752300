"""Replay a space's grid records (``DIR/grid-cache`` of ``forge bench sweep``) through the bench's
ASHA schedule and rule (``run_asha`` with ``replayer``: no training) for other first rungs, and
print each one's compute ratio and regret. The run's own values only (``rung_eval: value``).

    python load/sweep/replay_rungs.py --space load/sweep/space-lr-wd.yaml \\
        --records /tmp/sw/b3/grid-cache --first 27,54,81

(RESULTS.md, 2026-12-05: a later first rung on ``tiny-lr-wd-wsd``.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from forge_experiments.sweepspace import parse
from forge_training.bench.sweep import replayer, run_asha


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--space", type=Path, required=True)
    parser.add_argument("--records", type=Path, required=True, help="a bench run's grid-cache folder")
    parser.add_argument("--first", default="27", help="first rungs to try, comma-separated")
    args = parser.parse_args()
    space = parse(args.space.read_bytes())
    records = [json.loads(p.read_text()) for p in sorted(args.records.glob("*.json"))]
    by_params = {json.dumps(r["params"], sort_keys=True): r for r in records}
    configs = space.configurations()
    chosen = [by_params[json.dumps(p, sort_keys=True)] for p in configs]  # KeyError: a missing record
    curves = {i: [(int(s), float(v)) for s, v in r["curve"]] for i, r in enumerate(chosen)}
    finals = [float(r["final"]) for r in chosen]
    grid_steps = sum(int(r["steps"]) for r in chosen)
    sign = 1.0 if space.mode == "min" else -1.0
    grid_best = min(finals, key=lambda v: sign * v)
    for first in (int(f) for f in args.first.split(",")):
        es = dataclasses.replace(space.early_stopping, min_steps=first, rung_eval="value")
        variant = dataclasses.replace(space, early_stopping=es)
        plan = [(p, None) for p in configs]
        trials, rule, resumed = run_asha(variant, plan, first, replayer(variant, curves))
        done = [t for t in trials if t.final is not None]
        best = min(done, key=lambda t: sign * (t.final or 0.0))
        line = {
            "first_rung": first,
            "rungs": rule.rungs,
            "compute_ratio": round(sum(t.steps for t in trials) / grid_steps, 3),
            "regret": round(sign * ((best.final or 0.0) - grid_best), 4),
            "best_trial": best.index,
            "rung_occupancy": rule.occupancy(),
            "resumed": resumed,
        }
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
