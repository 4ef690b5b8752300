"""Statistics with known answers."""

from __future__ import annotations

import math

import pytest

from forge_eval import stats


def test_mcnemar_exact_matches_the_binomial_by_hand() -> None:
    # b = 10, c = 12: p = 2 * P(X <= 10), X ~ Bin(22, 1/2); sum_{k<=10} C(22, k) = (2^22 - C(22, 11)) / 2.
    assert stats.mcnemar_exact(10, 12) == pytest.approx(2 * 1_744_436 / 4_194_304)
    assert stats.mcnemar_exact(0, 30) == pytest.approx(2 * 0.5**30)
    assert stats.mcnemar_exact(0, 0) == 1.0
    assert stats.mcnemar_exact(5, 5) == 1.0


def test_sign_flip_is_exact_for_small_samples() -> None:
    # Five positive differences: only the all-plus and all-minus sign patterns reach |sum| = 15.
    assert stats.sign_flip_p([1, 2, 3, 4, 5]) == pytest.approx(2 / 32)
    # Symmetric differences: every sign pattern is at least as extreme as the observed sum 0.
    assert stats.sign_flip_p([1, -1, 2, -2]) == 1.0


def test_paired_binary_improvement_is_detected() -> None:
    baseline = [1.0] * 50 + [0.0] * 50
    candidate = [1.0] * 80 + [0.0] * 20
    result = stats.paired_compare(baseline, candidate, seed=3)
    assert (result.baseline, result.candidate, result.delta, result.n) == (0.5, 0.8, pytest.approx(0.3), 100)
    assert result.test == "mcnemar" and result.p_value == pytest.approx(2 * 0.5**30)
    # The bootstrap interval of a mean of 30 ones in 100 is about 0.3 ± 1.96 * 0.046.
    assert 0.18 < result.ci_low < 0.3 < result.ci_high < 0.42


def test_identical_runs_show_no_difference() -> None:
    scores = [1.0, 0.0, 1.0, 1.0]
    result = stats.paired_compare(scores, scores)
    assert (result.delta, result.ci_low, result.ci_high, result.p_value) == (0.0, 0.0, 0.0, 1.0)


def test_pairing_beats_an_unpaired_view() -> None:
    # Candidate fixes 12 examples and breaks 2: McNemar sees 12 vs 2 discordant pairs.
    baseline = [1.0] * 40 + [0.0] * 12 + [1.0] * 2 + [0.0] * 46
    candidate = [1.0] * 40 + [1.0] * 12 + [0.0] * 2 + [0.0] * 46
    result = stats.paired_compare(baseline, candidate)
    assert result.p_value == pytest.approx(stats.mcnemar_exact(2, 12)) and result.p_value < 0.05
    assert result.ci_low > 0


def test_continuous_scores_use_the_sign_flip_test() -> None:
    result = stats.paired_compare([0.1, 0.2, 0.3, 0.4, 0.5], [1.1, 2.2, 3.3, 4.4, 5.5])
    assert result.test == "sign-flip" and result.p_value == pytest.approx(2 / 32)


def test_mean_estimate_interval_is_seeded_and_brackets_the_mean() -> None:
    scores = [1.0] * 30 + [0.0] * 70
    first, again = stats.mean_estimate(scores, seed=5), stats.mean_estimate(scores, seed=5)
    assert first == again and first.n == 100
    assert first.ci_low < first.value == 0.3 < first.ci_high
    assert math.isnan(stats.mean_estimate([]).value)


def test_mismatched_lengths_are_refused() -> None:
    with pytest.raises(ValueError):
        stats.paired_compare([1.0], [1.0, 0.0])
