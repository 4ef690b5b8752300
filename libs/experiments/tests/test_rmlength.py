"""Reward-model accuracy by which reply is longer: the arithmetic on a worked example, and the
gate refusing a length detector while passing a judge of quality."""

from __future__ import annotations

import math
import random

import pytest

from forge_experiments import rmlength
from forge_kit.stats import wilson_interval


def test_wilson_interval_matches_the_published_worked_example() -> None:
    # 8 successes of 10: the 95% Wilson interval is [0.4902, 0.9433] (Wilson 1927; Newcombe 1998).
    low, high = wilson_interval(8, 10)
    assert (round(low, 4), round(high, 4)) == (0.4902, 0.9433)
    assert wilson_interval(0, 0) == (0.0, 1.0)  # nothing known


def test_strata_are_decided_by_word_counts() -> None:
    assert rmlength.stratum("a longer reply here", "short one") == "preferred_longer"
    assert rmlength.stratum("no", "no, not at all") == "preferred_shorter"
    assert rmlength.stratum("yes  indeed\n", "no way") == "tie"  # whitespace runs count once


def test_stratified_accuracy_on_a_worked_example() -> None:
    # preferred-longer: 8 right of 10; preferred-shorter: 1 right, 1 score tie, 2 wrong of 4 (1.5);
    # ties: none.
    strata = ["preferred_longer"] * 10 + ["preferred_shorter"] * 4
    chosen = [1.0] * 8 + [0.0] * 2 + [1.0, 0.5, 0.0, 0.0]
    rejected = [0.0] * 8 + [1.0] * 2 + [0.0, 0.5, 1.0, 1.0]
    got = rmlength.stratified_accuracy(strata, chosen, rejected)
    longer = got["preferred_longer"]
    assert (longer.accuracy, longer.n) == (0.8, 10)
    assert (round(longer.ci95_low, 4), round(longer.ci95_high, 4)) == (0.4902, 0.9433)
    shorter = got["preferred_shorter"]
    assert (shorter.accuracy, shorter.n) == (0.375, 4)
    assert (shorter.ci95_low, shorter.ci95_high) == pytest.approx(wilson_interval(1.5, 4))
    assert got["tie"].n == 0 and math.isnan(got["tie"].accuracy)
    written = rmlength.as_summary(got)
    assert written["unit"] == "words"
    assert written["tie"] == {"accuracy": None, "ci95_low": None, "ci95_high": None, "n": 0}
    assert written["preferred_longer"]["n"] == 10
    metrics = rmlength.registry_metrics({"by_length": written})
    assert metrics["heldout_preferred_longer_accuracy"] == 0.8 and metrics["heldout_tie_n"] == 0.0
    assert "heldout_tie_accuracy" not in metrics and metrics["heldout_preferred_shorter_n"] == 4.0
    assert rmlength.registry_metrics({"accuracy": 0.6}) == {}


def test_mismatched_or_unknown_input_is_refused() -> None:
    with pytest.raises(ValueError, match="same length"):
        rmlength.stratified_accuracy(["tie"], [1.0, 2.0], [0.0])
    with pytest.raises(ValueError, match="unknown stratum"):
        rmlength.stratified_accuracy(["longest"], [1.0], [0.0])
    with pytest.raises(ValueError, match="wins"):
        rmlength.StratumAccuracy.of(3, 2)


def _pairs(n: int, seed: int) -> list[tuple[str, str, float, float]]:
    """Pairs whose chosen reply is better by a hidden quality and longer about half the time:
    (chosen, rejected, chosen quality, rejected quality)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(1, 60), rng.randint(1, 60)
        if a == b:
            b += 1
        qa, qb = rng.random(), rng.random()
        good, bad = (qa, qb) if qa > qb else (qb, qa)
        out.append(("w " * a, "w " * b, good, bad))
    return out


def _summary(pairs: list[tuple[str, str, float, float]], score: str) -> dict[str, object]:
    strata = [rmlength.stratum(c, r) for c, r, _, _ in pairs]
    if score == "length":  # the length detector: reward = number of words
        chosen = [float(rmlength.words(c)) for c, _, _, _ in pairs]
        rejected = [float(rmlength.words(r)) for _, r, _, _ in pairs]
    else:  # a judge of quality that is right 80 % of the time, whatever the lengths
        rng = random.Random(7)
        flips = [rng.random() < 0.2 for _ in pairs]
        chosen = [q if not f else -q for (_, _, q, _), f in zip(pairs, flips, strict=True)]
        rejected = [q if not f else -q for (_, _, _, q), f in zip(pairs, flips, strict=True)]
    return {"by_length": rmlength.as_summary(rmlength.stratified_accuracy(strata, chosen, rejected))}


def test_the_gate_refuses_a_length_detector_and_passes_a_quality_judge() -> None:
    pairs = _pairs(400, seed=3)
    detector = _summary(pairs, "length")
    assert detector["by_length"]["preferred_longer"]["accuracy"] == 1.0  # type: ignore[index]
    reason = rmlength.length_gate(detector)
    assert reason.startswith("judges length, not quality: accuracy 0.000")
    assert "exceed 0.50" in reason
    assert rmlength.length_gate(_summary(pairs, "quality")) == ""
    # configurable: a stricter floor refuses the same judge
    assert "exceed 0.90" in rmlength.length_gate(_summary(pairs, "quality"), min_shorter_low=0.9)


def test_the_gate_refuses_too_few_shorter_pairs_and_malformed_summaries() -> None:
    few = _summary(_pairs(20, seed=1), "quality")
    assert "at least 30 are needed" in rmlength.length_gate(few, min_shorter_n=30)
    none = {
        "by_length": {"preferred_shorter": {"accuracy": None, "ci95_low": None, "ci95_high": None, "n": 0}}
    }
    assert "only 0 held-out pairs" in rmlength.length_gate(none)
    assert "no 'by_length'" in rmlength.length_gate({"accuracy": 0.7})
    assert "malformed" in rmlength.length_gate({"by_length": {"preferred_shorter": {"n": "x"}}})
