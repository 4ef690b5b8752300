"""A length-decorrelated reward, post hoc: the reward model's score less a length term fitted on
the model's **training** pairs only.

``python -m forge_training.rm.residual --checkpoint DIR --train-pairs FILE`` scores both replies
of every training pair with the checkpoint as it is (raw: any earlier adjustment ignored), fits
by least squares ``score = intercept + slope x log(1 + words in the reply)`` over those replies,
and writes ``DIR/length_adjust.json`` (:class:`forge_training.rm.eval.LengthAdjust`). From then on
every score read from that folder (``forge rm eval``, the RLHF round's gate, the policy check) is
``score - slope x log(1 + words)``: on the training replies it is uncorrelated with the length
term, so the correction is a property of the model and its training data, never of the pairs it
is later evaluated on. A reward model trained on the reward recipe writes its training pairs to
``<cache dir>/train_pairs.jsonl`` (:class:`~forge_training.objectives.reward.EncoderRewardModeling`).

The reply's length enters as ``log(1 + words)``, chosen before any measurement: reward-model
scores grow with length less than linearly, and a log keeps a few very long replies from
setting the slope. A pairs file that cannot be read exits 2 naming the line and the field.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from forge_training.rm.eval import (
    LengthAdjust,
    Pair,
    PairsError,
    RewardModel,
    evaluate,
    file_sha256,
    length_feature,
    read_pairs,
)

#: Fewer training replies than this cannot fit a slope worth applying.
MIN_REPLIES = 20


def fit_length_adjust(rewards: Sequence[float], responses: Sequence[str], fitted_on: str) -> LengthAdjust:
    """Least squares of ``rewards`` on :func:`length_feature` of ``responses`` (one per reply).
    Raises PairsError with too few replies or when every reply has the same length term."""
    if len(rewards) != len(responses):
        raise ValueError("one reward per response")
    if len(rewards) < MIN_REPLIES:
        raise PairsError(f"--train-pairs: {len(rewards)} replies, fewer than {MIN_REPLIES} to fit on")
    x = np.array([length_feature(r) for r in responses], dtype=np.float64)
    y = np.array(rewards, dtype=np.float64)
    spread = float(((x - x.mean()) ** 2).sum())
    if spread <= 1e-9 * len(x):  # rounding leaves ~1e-30 when every term is equal
        raise PairsError("--train-pairs: every reply has the same length; no slope can be fitted")
    slope = float(((x - x.mean()) * (y - y.mean())).sum() / spread)
    return LengthAdjust(slope, float(y.mean() - slope * x.mean()), len(rewards), fitted_on)


def fit_checkpoint(checkpoint: Path, train_pairs: Path, *, batch_size: int = 16) -> LengthAdjust:
    """Score ``train_pairs`` with the raw checkpoint and fit its :class:`LengthAdjust` (not written)."""
    skipped: Counter[str] = Counter()
    pairs: list[Pair] = list(read_pairs(train_pairs, skipped))
    model = RewardModel(checkpoint, raw=True)
    scores = evaluate(model, iter(pairs), batch_size=batch_size)
    rewards = [*scores.chosen, *scores.rejected]
    responses = [*(p.chosen for p in pairs), *(p.rejected for p in pairs)]
    return fit_length_adjust(rewards, responses, f"sha256:{file_sha256(train_pairs)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="forge_training.rm.residual")
    parser.add_argument("--checkpoint", type=Path, required=True, help="Hugging Face reward-model folder")
    parser.add_argument(
        "--train-pairs", type=Path, required=True, help="the model's training pairs (.jsonl[.gz])"
    )
    parser.add_argument("--batch-size", type=int, default=16, help="pairs per forward pass")
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        parser.error("--batch-size must be >= 1")
    try:
        adjust = fit_checkpoint(args.checkpoint, args.train_pairs, batch_size=args.batch_size)
        adjust.write(args.checkpoint)
    except (PairsError, OSError) as exc:
        print(f"rm_residual: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(adjust.__dict__, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
