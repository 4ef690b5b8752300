"""Record a space's grid (every configuration at the full budget, as ``forge bench sweep`` trains
its grid side) with an evaluation every ``--eval-every`` steps and a cooldown branch at rungs
``eval-every × 3^k`` (``rung_values``; the branches leave the trial's curve as it is), into ``OUT/grid-cache``: the
per-step validation curves that ``replay_rules.py`` replays candidate early-stopping rules on.
A configuration with a record there already is not trained again.

    nice -n 10 python load/sweep/record_grid.py --space load/sweep/space-lr-beta2-ffn.yaml \\
        --out /tmp/rec/beta2 --eval-every 9

(RESULTS.md, 2026-12-06.)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from forge_experiments.sweepspace import parse
from forge_training.bench.sweep import grid_trials


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--space", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--eval-every", type=int, default=9, help="evaluation cadence (steps)")
    parser.add_argument(
        "--cooldown",
        type=float,
        default=0.1,
        help="cooldown branch fraction at rungs eval-every x 3^k (0: none)",
    )
    parser.add_argument(
        "--reverse",
        action="store_true",
        help="train the configurations last first (a second process on one grid)",
    )
    args = parser.parse_args()
    space = parse(args.space.read_bytes())
    extra: dict[str, float | int] = {"eval_interval": args.eval_every}
    if args.cooldown > 0:  # branches restore the trial's state: the curve is the same without them
        extra.update({"rung_cooldown.fraction": args.cooldown, "rung_cooldown.min_steps": args.eval_every})
        extra["rung_cooldown.eta"] = 3
    space = dataclasses.replace(space, overrides={**space.overrides, **extra})
    seeds: list[int | None] = list(space.seeds) or [None]
    plan = [(p, s) for p in space.configurations() for s in seeds]
    grid, reused = grid_trials(
        space,
        plan,
        args.out / "runs",
        args.out / "cache",
        args.out / "grid-cache",
        echo=lambda line: print(line, file=sys.stderr, flush=True),
        reverse=args.reverse,
    )
    for t in grid:
        print(t.index, t.params, t.final, flush=True)
    print(f"reused {reused} of {len(grid)}", flush=True)


if __name__ == "__main__":
    main()
