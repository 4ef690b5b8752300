"""The post-hoc length-decorrelated reward (:mod:`forge_training.rm.residual`).

A least-squares length term fitted on a reward model's training pairs is written beside the
checkpoint; every score read from that folder is then the raw score less the term, so the
scores of the training replies are uncorrelated with length, the held-out pairs play no part in
the fit, and ``forge rm eval`` (``rm_score``), the RLHF round's gate, reads the corrected reward.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from forge_experiments import rmlength
from forge_training.backbones import minilm_dir
from forge_training.objectives.encoder import encoder_classifier, save_encoder
from forge_training.pairs import ENCODER_CHAT_TEMPLATE, PreferencePair, write_pairs
from forge_training.rm import residual as rm_residual
from forge_training.rm import score as rm_score
from forge_training.rm.eval import (
    LENGTH_ADJUST_FILE,
    LengthAdjust,
    PairsError,
    RewardModel,
    evaluate,
    file_sha256,
    length_feature,
    read_pairs,
)
from forge_training.schema import InitConfig


def _corr(x: list[float], y: list[float]) -> float:
    return float(np.corrcoef(np.array(x), np.array(y))[0, 1])


def test_the_fit_recovers_the_length_slope_and_leaves_the_training_rewards_uncorrelated() -> None:
    rng = random.Random(4)
    responses = [" ".join(["word"] * rng.randint(1, 200)) for _ in range(400)]
    quality = [rng.gauss(0.0, 1.0) for _ in responses]
    rewards = [1.5 * length_feature(r) + q - 0.3 for r, q in zip(responses, quality, strict=True)]
    adjust = rm_residual.fit_length_adjust(rewards, responses, "sha256:x")
    assert adjust.slope == pytest.approx(1.5, abs=0.15) and adjust.n == 400
    corrected = [adjust.apply(s, r) for s, r in zip(rewards, responses, strict=True)]
    features = [length_feature(r) for r in responses]
    assert _corr(rewards, features) > 0.7
    assert abs(_corr(corrected, features)) < 1e-9  # least squares: exactly uncorrelated on its data
    assert _corr(corrected, quality) > 0.9  # what is left is the quality
    with pytest.raises(PairsError, match="fewer than 20"):
        rm_residual.fit_length_adjust(rewards[:5], responses[:5], "x")
    with pytest.raises(PairsError, match="same length"):
        rm_residual.fit_length_adjust(rewards[:30], ["a b"] * 30, "x")


def test_a_bad_length_adjustment_file_is_refused(tmp_path: Path) -> None:
    assert LengthAdjust.read(tmp_path) is None
    LengthAdjust(0.5, 0.1, 40, "sha256:abc").write(tmp_path)
    assert LengthAdjust.read(tmp_path) == LengthAdjust(0.5, 0.1, 40, "sha256:abc")
    for body in ("not json", '{"slope": 1}', '{"slope": NaN, "intercept": 0, "n": 2, "fitted_on": "x", '
                 '"feature": "log1p_words"}', '{"slope": 1, "intercept": 0, "n": 2, "fitted_on": "x", '
                 '"feature": "tokens"}'):  # fmt: skip
        (tmp_path / LENGTH_ADJUST_FILE).write_text(body)
        with pytest.raises(PairsError, match=r"length_adjust\.json"):
            LengthAdjust.read(tmp_path)
    (tmp_path / LENGTH_ADJUST_FILE).write_text(" " * (70 << 10))
    with pytest.raises(PairsError, match="bytes"):
        LengthAdjust.read(tmp_path)


def _pairs(seed: int, n: int) -> list[PreferencePair]:
    rng = random.Random(seed)
    vocab = ["the", "dog", "runs", "quickly", "home", "and", "sleeps", "well", "today", "again"]
    out = []
    for i in range(n):
        a, b = (" ".join(rng.choice(vocab) for _ in range(rng.randint(1, 40))) for _ in range(2))
        out.append(PreferencePair((("user", f"question {seed}-{i}?"),), a, b))
    return out


def test_a_residualised_checkpoint_scores_the_raw_reward_less_the_term_fitted_on_training_pairs(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    source = minilm_dir()
    model = encoder_classifier(source, 64, 0, InitConfig(backbone="minilm"))
    checkpoint = save_encoder(
        model.eval(), source, tmp_path / "hf", 64, truncation_side="left", chat_template=ENCODER_CHAT_TEMPLATE
    )
    train = write_pairs(tmp_path / "train_pairs.jsonl", _pairs(1, 24))
    held = write_pairs(tmp_path / "held_out_pairs.jsonl", _pairs(2, 10))
    before = rm_score.score_pairs(checkpoint, held, tmp_path / "before")
    assert rm_residual.main(["--checkpoint", str(checkpoint), "--train-pairs", str(train)]) == 0
    adjust = LengthAdjust.read(checkpoint)
    assert adjust is not None and adjust.n == 48 and adjust.fitted_on == f"sha256:{file_sha256(train)}"
    # On the training replies the corrected reward is uncorrelated with the length term.
    train_pairs = list(read_pairs(train, Counter()))
    fitted = evaluate(RewardModel(checkpoint), iter(train_pairs))
    replies = [p.chosen for p in train_pairs] + [p.rejected for p in train_pairs]
    assert abs(_corr(fitted.chosen + fitted.rejected, [length_feature(r) for r in replies])) < 1e-6
    # Held-out pairs: the raw score less slope x log(1 + words), through forge rm eval's scorer.
    held_pairs = list(read_pairs(held, Counter()))
    raw = evaluate(RewardModel(checkpoint, raw=True), iter(held_pairs))
    after = rm_score.score_pairs(checkpoint, held, tmp_path / "after")
    scored = evaluate(RewardModel(checkpoint), iter(held_pairs))
    for pair, r, s in zip(held_pairs, raw.chosen, scored.chosen, strict=True):
        assert s == pytest.approx(r - adjust.slope * math.log1p(len(pair.chosen.split())), abs=1e-5)
    one = RewardModel(checkpoint)  # one reply's reward, as the policy check reads it: the same
    assert one.reward(held_pairs[0].messages, held_pairs[0].chosen) == pytest.approx(
        scored.chosen[0], abs=1e-5
    )
    details = json.loads((tmp_path / "after" / "details.json").read_text())
    assert details["length_adjust"]["slope"] == adjust.slope
    assert json.loads((tmp_path / "before" / "details.json").read_text())["length_adjust"] is None
    assert before["n"] == after["n"] == 10
    # The by-length figures the RLHF round's gate reads (rm_length_gate) are the corrected reward's.
    corrected = rmlength.stratified_accuracy(scored.strata, scored.chosen, scored.rejected)
    assert after["by_length"] == rmlength.as_summary(corrected)
    assert isinstance(rmlength.length_gate(after), str)
    # A training file that cannot be read leaves the checkpoint as it was.
    (checkpoint / LENGTH_ADJUST_FILE).unlink()
    assert rm_residual.main(["--checkpoint", str(checkpoint), "--train-pairs", str(tmp_path / "none")]) == 2
    assert not (checkpoint / LENGTH_ADJUST_FILE).exists()
