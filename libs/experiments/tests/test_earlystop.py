"""ASHA's promotion rule and median stopping against hand-worked examples."""

from __future__ import annotations

import math

import pytest

from forge_experiments.earlystop import Asha, AshaPromotion, MedianStopping, rungs


def test_rungs_are_r_times_powers_of_eta_below_the_full_budget() -> None:
    assert rungs(1, 3, 27) == [1, 3, 9]
    assert rungs(9, 3, 243) == [9, 27, 81]
    assert rungs(5, 2, 41) == [5, 10, 20, 40]
    with pytest.raises(ValueError):
        rungs(0, 3, 10)


def test_asha_worked_example() -> None:
    """η = 3, rungs at 1, 3, 9 (full budget 27), minimising. Trials arrive one by one at rung 1:

    a=5.0: n=1, keep max(1, 1//3)=1 → best of {5.0} → continue
    b=4.0: n=2, keep 1 → best is 4.0 → b continues
    c=6.0: n=3, keep 1 → best 4.0, 6.0 is not → stop
    d=4.5: n=4, keep 1 → best 4.0 → stop
    e=3.0: n=5, keep 1 → best 3.0 → continue
    f=4.2: n=6, keep 2 → best two {3.0, 4.0} → 4.2 stops
    g=3.9: n=7, keep 2 → best two {3.0, 3.9} → continue
    At rung 3: b=3.5 (n=1, continue), e=2.5 (n=2, keep 1, best → continue), g=3.6 (n=3, keep 1:
    best is 2.5 → stop), a=3.4 (n=4 → keep 1 → stop).
    """
    rule = Asha(min_steps=1, eta=3, max_steps=27, mode="min")
    first = {"a": 5.0, "b": 4.0, "c": 6.0, "d": 4.5, "e": 3.0, "f": 4.2, "g": 3.9}
    decisions = {t: rule.report(t, 1, v) for t, v in first.items()}
    assert decisions == {
        "a": "continue",
        "b": "continue",
        "c": "stop",
        "d": "stop",
        "e": "continue",
        "f": "stop",
        "g": "continue",
    }
    second = [("b", 3.5, "continue"), ("e", 2.5, "continue"), ("g", 3.6, "stop"), ("a", 3.4, "stop")]
    for trial, value, expected in second:
        assert rule.report(trial, 3, value) == expected, trial
    assert rule.occupancy() == {1: 7, 3: 4, 9: 0}
    assert rule.stopped == {"c": 1, "d": 1, "f": 1, "g": 3, "a": 3}


def test_asha_ignores_non_rung_steps_repeats_and_stopped_trials() -> None:
    rule = Asha(min_steps=2, eta=2, max_steps=16, mode="max")
    assert rule.report("x", 1, 0.5) == "ignore"  # before the first rung
    assert rule.report("x", 2, 0.5) == "continue"
    assert rule.report("x", 2, 0.1) == "ignore"  # judged at that rung already
    assert rule.report("x", 3, 0.9) == "ignore"  # between rungs
    assert rule.report("y", 2, 0.7) == "continue"  # max mode: 0.7 beats 0.5 (keep 1 of 2)
    assert rule.report("z", 2, 0.1) == "stop"
    assert rule.report("z", 4, 0.99) == "ignore"  # stopped trials stay stopped


def test_asha_coarse_report_fills_every_rung_passed_and_nan_ranks_last() -> None:
    rule = Asha(min_steps=1, eta=3, max_steps=27, mode="min")
    assert rule.report("a", 10, 2.0) == "continue"  # judged at rung 9, recorded at 1, 3, 9
    assert rule.occupancy() == {1: 1, 3: 1, 9: 1}
    assert rule.report("b", 1, 1.0) == "continue"
    assert rule.report("c", 1, math.nan) == "stop"


def test_median_stopping_worked_example() -> None:
    rule = MedianStopping(min_steps=10, min_trials=2, mode="min")
    assert rule.report("a", 10, 3.0) == "continue"  # no others yet
    assert rule.report("b", 10, 2.0) == "continue"  # one other
    assert rule.report("c", 10, 2.8) == "stop"  # median of {3.0, 2.0} = 2.5 < 2.8
    assert rule.report("d", 10, 2.4) == "continue"  # median of {3.0, 2.0, 2.8} = 2.8
    assert rule.report("e", 5, 9.0) == "continue"  # before min_steps
    assert rule.report("c", 20, 0.1) == "ignore"


def test_asha_promotion_form_worked_example() -> None:
    """Li et al. 2020, Algorithm 2: η = 3, rungs 1, 3, 9 (full budget 27), minimising. Trials reach
    rung 1 one by one; after each, its worker asks for a promotion before a new trial starts.

    a=5.0: n=1, top 1//3=0 → pause; no promotion.      b=4.0: n=2, top 0 → pause; none.
    c=6.0: n=3, top 1 = {b}: c pauses; the free worker resumes b (rung 1 → 3).
    d=4.5: n=4, top 1 = {b}, promoted already → pause; none.
    e=3.0: n=5, top 1 = {e} → continue at once.
    f=4.2: n=6, top 2 = {e, b} → pause; none (both promoted).
    g=3.9: n=7, top 2 = {e, g} → continue at once.
    At rung 3: b=3.5 (n=1 → pause), e=2.5 (n=2 → pause), g=3.6 (n=3, top 1 = {e}: g pauses,
    e is resumed to rung 9). No trial is left to start: once nothing is in flight under rung 3,
    rung 1 (top max(1, 7//3) = 2, both promoted) gives nothing, and rung 9 (n=0) neither.
    """
    rule = AshaPromotion(min_steps=1, eta=3, max_steps=27, mode="min")
    arrivals = [("a", 5.0), ("b", 4.0), ("c", 6.0), ("d", 4.5), ("e", 3.0), ("f", 4.2), ("g", 3.9)]
    decisions, promotions = {}, {}
    for trial, value in arrivals:
        decisions[trial] = rule.report(trial, 1, value)
        if decisions[trial] == "pause":
            promotions[trial] = rule.next_promotion()
    assert decisions == {
        "a": "pause",
        "b": "pause",
        "c": "pause",
        "d": "pause",
        "e": "continue",
        "f": "pause",
        "g": "continue",
    }
    assert promotions == {"a": None, "b": None, "c": ("b", 1), "d": None, "f": None}
    assert [rule.report(t, 3, v) for t, v in (("b", 3.5), ("e", 2.5), ("g", 3.6))] == ["pause"] * 3
    assert rule.next_promotion() == ("e", 3)
    assert rule.paused_at("g") == 3 and rule.paused_at("a") == 1 and rule.paused_at("e") is None
    assert rule.next_promotion(final_below=3) is None
    assert rule.report("e", 9, 2.0) == "pause"  # alone at rung 9: 1 // 3 = 0
    assert rule.next_promotion() is None
    assert rule.next_promotion(final_below=9) == ("e", 9)  # nothing else can come: it goes on
    assert rule.occupancy() == {1: 7, 3: 3, 9: 1}


def test_asha_promotion_a_diverged_trial_ranks_last_and_a_forgotten_one_frees_its_place() -> None:
    rule = AshaPromotion(min_steps=2, eta=2, max_steps=8, mode="max")
    assert rule.report("x", 1, 0.5) == "ignore"
    assert rule.report("x", 2, float("nan")) == "pause"
    assert rule.report("y", 2, 0.1) == "continue"  # n=2, top 1: 0.1 beats NaN
    assert rule.report("x", 2, 0.9) == "ignore"  # judged there already
    rule.forget("y")
    assert rule.next_promotion(final_below=2) == ("x", 2)


# val_loss of the 12 configurations of load/sweep/space-lr-wd.yaml at step 27 (lr 0.0005, 0.0015,
# 0.0045, 0.0135 x weight decay 0, 0.1, 0.3), as the runs report it and after a 3-step cooldown
# branch (RESULTS.md, 2026-12-05). Configurations 3-5 (lr 0.0015) end best at step 243.
OWN_27 = [5.3527, 5.3530, 5.3535, 5.2083, 5.2084, 5.2086, 5.0714, 5.0714, 5.0740, 5.2769, 5.2064, 5.2532]
COOLED_27 = [5.3259, 5.3261, 5.3267, 5.1730, 5.1732, 5.1735, 5.0181, 5.0174, 5.0230, 5.2609, 5.1811, 5.2344]


@pytest.mark.parametrize(("values", "fourth"), [(OWN_27, "10"), (COOLED_27, "3")])
def test_a_full_rung_promotes_its_top_third_whatever_the_value_measures(
    values: list[float], fourth: str
) -> None:
    """The rule is the same for both rung evaluations; the values decide. Rung 27 of 12 keeps 4:
    the three lr 0.0045 configurations, then a near tie for fourth place, lost by lr 0.0015 on the
    run's own values (by 0.002) and won after the cooldown branch (by 0.008)."""
    rule = AshaPromotion(min_steps=27, eta=3, max_steps=243)
    # Best first: no arrival is ever in the top third of its rung at once (each pauses).
    order = sorted(range(len(values)), key=lambda t: values[t])
    assert {rule.report(str(t), 27, values[t]) for t in order} == {"pause"}
    promoted = []
    while (found := rule.next_promotion(final_below=27)) is not None:
        promoted.append(found[0])
    assert sorted(promoted) == sorted(["6", "7", "8", fourth])
