"""The load suite (``make load``; ``make bench`` runs the same).

    python -m load run  [--scenarios a,b,...] [--seconds 20] [--out var/load] [--dataset BEIR_DIR]
                        [--documents 1000] [--preferences 1500]
    python -m load soak [--minutes 30] [--sample-s 15] [--warmup 0.25] [--rss-growth 0.10] [--out var/load/soak]
    python -m load list

Scenarios start their own service processes on free ports (127.0.0.1 only) and stop them; they
need the repository's ``.venv`` (``make install``), and PostgreSQL is not used (SQLite per service).
See ``load/README.md`` for the thresholds and where each came from.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from load.suite import runner, soak
from load.suite.scenarios import DEFAULT_BEIR


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m load", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="every scenario once, checked against load/thresholds.toml")
    run.add_argument("--scenarios", default=",".join(runner.SCENARIOS))
    run.add_argument("--seconds", type=float, default=20.0, help="how long each driven scenario runs")
    run.add_argument("--out", type=Path, default=Path("var/load"))
    run.add_argument("--dataset", type=Path, default=DEFAULT_BEIR, help="a BEIR folder for the RAG scenario")
    run.add_argument("--documents", type=int, default=300, help="documents of --dataset to ingest")
    run.add_argument("--preferences", type=int, default=1500, help="preferences the ingest scenario posts")
    long = commands.add_parser("soak", help="mixed traffic for --minutes; memory and error rate checked")
    long.add_argument("--minutes", type=float, default=30.0)
    long.add_argument("--sample-s", type=float, default=15.0)
    long.add_argument("--warmup", type=float, default=0.25, help="share of the run before memory is compared")
    long.add_argument("--rss-growth", type=float, default=0.10, help="allowed memory growth after warm-up")
    long.add_argument("--out", type=Path, default=Path("var/load/soak"))
    long.add_argument("--dataset", type=Path, default=DEFAULT_BEIR)
    long.add_argument("--documents", type=int, default=500)
    commands.add_parser("list", help="the scenario names")
    args = parser.parse_args(argv)
    if args.command == "list":
        print("\n".join(runner.SCENARIOS))
        return 0
    if args.command == "run":
        if args.seconds <= 0 or args.documents < 1 or args.preferences < 1:
            parser.error("--seconds, --documents and --preferences must be positive")
        names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
        return runner.run(names, args.out, args)
    if args.minutes <= 0 or args.sample_s <= 0 or not 0 <= args.warmup < 1 or args.rss_growth < 0:
        parser.error("--minutes and --sample-s must be positive, --warmup in [0, 1), --rss-growth >= 0")
    return soak.soak(args.out, args)


if __name__ == "__main__":
    sys.exit(main())
