"""The kit's one Wilson interval and one percentile (every service uses these)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from forge_kit import stats
from forge_kit.stats import Z95, percentile, wilson_interval


def test_wilson_matches_the_textbook() -> None:
    # Newcombe (1998), table I: 8 of 10 -> 0.4902 to 0.9433; 0 of 20 -> 0 to 0.1611.
    low, high = wilson_interval(8, 10)
    assert (round(low, 4), round(high, 4)) == (0.4902, 0.9433)
    low, high = wilson_interval(0, 20)
    assert low == 0.0 and round(high, 4) == 0.1611
    # Symmetric about one half, and a tie counted as half a success is allowed.
    low, high = wilson_interval(12, 20)
    mirrored = wilson_interval(8, 20)
    assert math.isclose(low, 1 - mirrored[1]) and math.isclose(high, 1 - mirrored[0])
    assert wilson_interval(7.5, 10)[0] < 0.75 < wilson_interval(7.5, 10)[1]


def test_wilson_with_no_trials_is_the_whole_unit_interval() -> None:
    # The limit of the formula as n -> 0: nothing is known, so no threshold is met either way.
    assert wilson_interval(0, 0) == (0.0, 1.0)
    assert wilson_interval(0.0, 0.0) == (0.0, 1.0)
    low, high = wilson_interval(0, 1e-9)
    assert low == pytest.approx(0.0, abs=1e-6) and high == pytest.approx(1.0, abs=1e-6)


def test_wilson_rejects_more_successes_than_trials() -> None:
    with pytest.raises(ValueError, match="between 0 and n"):
        wilson_interval(11, 10)
    with pytest.raises(ValueError, match="between 0 and n"):
        wilson_interval(-1, 10)


def test_wilson_narrows_with_z() -> None:
    wide = wilson_interval(50, 100, Z95)
    narrow = wilson_interval(50, 100, 1.0)
    assert wide[0] < narrow[0] < 0.5 < narrow[1] < wide[1]


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 95) == 5.0
    values = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    for q in (0, 25, 50, 90, 95, 99, 100):
        assert percentile(values, q) == float(np.percentile(values, q))


def test_percentile_of_nothing_is_the_given_default() -> None:
    assert percentile([], 50) == 0.0
    assert math.isnan(percentile([], 99, empty=math.nan))


def test_percentile_rejects_a_fraction_for_a_percent() -> None:
    with pytest.raises(ValueError, match="between 0 and 100"):
        percentile([1.0], 101)
    with pytest.raises(ValueError, match="between 0 and 100"):
        percentile([1.0], -0.5)


def test_item_means_average_each_example_over_runs_and_paired_summary_names_the_figures() -> None:
    assert stats.item_means([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]]) == [0.5, 0.0, 1.0]
    with pytest.raises(ValueError):
        stats.item_means([[1.0, 0.0], [1.0]])
    result = stats.paired_compare([0.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0], seed=0)
    summary = result.summary()
    assert summary == {
        "delta": result.delta,
        "ci95": [result.ci_low, result.ci_high],
        "p_value": result.p_value,
        "test": "mcnemar",
        "n": 4,
    }
