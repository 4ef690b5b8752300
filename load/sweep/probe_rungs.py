"""What a rung sees: each configuration of a sweep space trained to ``--until`` steps with cooldown
branches at rungs ``--first × 3^k`` (``rung_cooldown.*``), printing the run's own metric and the
metric after each branch, for every ``--fraction``. One JSON line per (fraction, configuration).

    python load/sweep/probe_rungs.py --space load/sweep/space-lr-wd.yaml --out /tmp/probe \\
        --fractions 0.2,0.1 --first 9 --until 82 [--where optim.weight_decay=0.1]

(RESULTS.md, 2026-12-05: the rankings at rungs 9, 27 and 81 under the ``wsd`` schedule.)
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from forge_experiments.sweepspace import COOLDOWN_PREFIX, parse
from forge_kit.objectstore import ObjectStore
from forge_training import recipes
from forge_training.train import RunContext, train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--space", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--fractions", default="0.2")
    parser.add_argument("--first", type=int, default=9)
    parser.add_argument("--until", type=int, default=82)
    parser.add_argument("--where", default="", help="KEY=VALUE: only configurations with this value")
    args = parser.parse_args()
    space = parse(args.space.read_bytes())
    key, _, wanted = args.where.partition("=")
    metric, cooled = space.metric, COOLDOWN_PREFIX + space.metric
    for fraction in (float(f) for f in args.fractions.split(",")):
        for index, params in enumerate(space.configurations()):
            if key and str(params.get(key)) != wanted:
                continue
            overrides = {
                **space.trial_overrides(params),
                "rung_cooldown.fraction": fraction,
                "rung_cooldown.min_steps": args.first,
                "rung_cooldown.eta": 3,
            }
            run_dir = args.out / f"f{fraction}-{index:03d}"
            shutil.rmtree(run_dir, ignore_errors=True)
            ctx = RunContext(
                run_id=f"probe-{index}",
                run_dir=run_dir,
                store=ObjectStore(str(run_dir / "objects")),
                cache_dir=args.out / "cache",
                export=False,
                stop_after_step=args.until,
            )
            result = train(recipes.build(space.recipe, overrides), ctx)
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            line = {
                "fraction": fraction,
                "trial": index,
                "params": params,
                "own": {r["step"]: r[metric] for r in rows if metric in r},
                "cooldown": {r["step"]: r[cooled] for r in rows if cooled in r},
                "branch_steps": result.branch_steps,
            }
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
