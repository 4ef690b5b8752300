"""Scoring a file of preference pairs with a reward-model checkpoint, to an output folder: what
``forge rm eval`` runs on this machine and what the RLHF round's reward gate runs as a job
(``python -m forge_training.rm.score --checkpoint DIR --pairs FILE --out DIR``; services build
that command with :class:`forge_experiments.jobcmd.RewardModelEvalCommand`).

Writes ``OUT/summary.json`` (``accuracy``, ``ci95_low``, ``ci95_high``, ``n``), ``details.json``
and ``scores.jsonl.gz`` (see :mod:`forge_training.rm.eval`); a pairs file that cannot be read
exits 2 naming the line and the field.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from forge_training.rm.eval import PairsError, RewardModel, evaluate, file_sha256, read_pairs, write_results


def score_pairs(
    checkpoint: Path,
    pairs: Path,
    out: Path,
    *,
    batch_size: int = 16,
    max_length: int = 0,
    details: dict[str, Any] | None = None,
    on_scored: Callable[[int], None] = lambda count: None,
) -> dict[str, float | int]:
    """Score ``pairs`` with the checkpoint and write the results to ``out``; the summary.
    Raises :class:`PairsError` or :class:`OSError` for input that cannot be read."""
    skipped: Counter[str] = Counter()
    model = RewardModel(checkpoint, max_length=max_length)
    scores = evaluate(model, read_pairs(pairs, skipped), batch_size=batch_size, on_scored=on_scored)
    recorded = {
        **(details or {}),
        "checkpoint": str(checkpoint),
        "pairs_sha256": file_sha256(pairs),
        "skipped": dict(skipped),
        "max_length": model.max_length,
        "length_adjust": None if model.length_adjust is None else dict(model.length_adjust.__dict__),
    }
    return write_results(out, scores, recorded)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="forge_training.rm.score")
    parser.add_argument("--checkpoint", type=Path, required=True, help="Hugging Face reward-model folder")
    parser.add_argument("--pairs", type=Path, required=True, help="HH-RLHF pairs (.jsonl[.gz])")
    parser.add_argument("--out", type=Path, required=True, help="folder for summary.json")
    parser.add_argument("--batch-size", type=int, default=16, help="pairs per forward pass")
    parser.add_argument("--max-length", type=int, default=0, help="tokens per sequence (0: the model's)")
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.max_length < 0:
        parser.error("--batch-size must be >= 1 and --max-length >= 0")
    try:
        summary = score_pairs(
            args.checkpoint,
            args.pairs,
            args.out,
            batch_size=args.batch_size,
            max_length=args.max_length,
            details={"pairs_file": str(args.pairs), "reward_model": None},
        )
    except (PairsError, OSError) as exc:
        print(f"rm_score: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
