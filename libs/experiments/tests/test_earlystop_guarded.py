"""The guarded rule (ASHA's promotion form that promotes past a rung every trial while the
ranking there has not settled, and every trial the leader does not clearly beat) and the rungs'
trust report, against hand-worked examples."""

from __future__ import annotations

import math

import pytest

from forge_experiments.earlystop import (
    Guarded,
    curve_noise,
    default_min_steps,
    kendall_tau,
    rung_trust,
    spearman_rho,
)


def _feed(rule: Guarded, curves: dict[str, list[float]]) -> dict[str, str]:
    """Report steps 1, 2, 3 of each trial, step by step in trial order; the decision at rung 3."""
    decisions: dict[str, str] = {}
    for step in (1, 2, 3):
        for trial, values in curves.items():
            decision = rule.report(trial, step, values[step - 1])
            if step == 1:
                assert decision == "continue"  # the first rung promotes all: nothing to compare with
            elif step == 2:
                assert decision == "ignore"  # not a rung (its value is kept all the same)
            else:
                decisions[trial] = decision
    return decisions


def _promotions(rule: Guarded) -> list[tuple[str, int]]:
    out = []
    while (found := rule.next_promotion()) is not None:
        out.append(found)
    return out


def test_default_rungs_are_a_27th_a_9th_and_a_third_of_the_budget() -> None:
    assert default_min_steps(243) == 9 and default_min_steps(20) == 1
    assert Guarded(min_steps=default_min_steps(243), eta=3, max_steps=243).rungs == [9, 27, 81]


#: The guards' settings the worked examples exercise (the defaults turn two of them off).
NOISY = {"z": 2.0, "settled_tau": 0.6}


def test_a_settled_ranking_pauses_the_clearly_beaten() -> None:
    """Rungs 1, 3, 9 of 27. At rung 3 the first two arrivals wait (one and two trials at both
    rungs: under min_pairs = 3, nothing to say yet). With c the ranking is a < b < c at both
    rungs: τ = 1 ≥ 0.6, settled. keep = 3 // 3 = 1: a. Noise: second differences a 0, b
    5.5 - 9.2 + 3.6 = -0.1, c 6 - 10 + 4.5 = 0.5, so σ = median(0, 0.1/√6, 0.5/√6) = 0.0408 and
    the margin 2·√2·σ = 0.115. b is 0.6 behind a (0.5 at rung 1: it lost ground), c 1.5 (1.0):
    neither is protected. Only a is promoted."""
    rule = Guarded(min_steps=1, eta=3, max_steps=27, **NOISY)
    decisions = _feed(rule, {"a": [5.0, 4.0, 3.0], "b": [5.5, 4.6, 3.6], "c": [6.0, 5.0, 4.5]})
    assert decisions == {"a": "pause", "b": "pause", "c": "pause"}
    assert rule.settled(3) is True and rule.noise(3) == pytest.approx(0.1 / math.sqrt(6))
    assert _promotions(rule) == [("a", 3)]


def test_a_ranking_that_moved_between_rungs_promotes_every_trial() -> None:
    """At rung 1 a < b < c, at rung 3 c < b < a: τ = -1, not settled, so all three go on (c at
    once, as it arrives; a and b, paused before, from the promotion queue, best first)."""
    rule = Guarded(min_steps=1, eta=3, max_steps=27, **NOISY)
    decisions = _feed(rule, {"a": [5.0, 4.5, 4.4], "b": [5.5, 4.6, 4.0], "c": [6.0, 4.9, 3.5]})
    assert decisions == {"a": "pause", "b": "pause", "c": "continue"}
    assert rule.settled(3) is False
    assert _promotions(rule) == [("b", 3), ("a", 3)]
    # the defaults require no settled ranking (τ ≥ -1): c, the top third, goes on; a and b were
    # ahead of c at rung 1 and are behind it now (they lost ground, no margin): both wait
    plain = Guarded(min_steps=1, eta=3, max_steps=27)
    assert _feed(plain, {"a": [5.0, 4.5, 4.4], "b": [5.5, 4.6, 4.0], "c": [6.0, 4.9, 3.5]})["c"] == "continue"
    assert plain.settled(3) is True and _promotions(plain) == []


def test_a_trial_within_the_noise_of_the_leader_goes_on() -> None:
    """Every curve's second difference is -0.2: σ = 0.2/√6 = 0.0816, margin 0.231. b is 0.1
    behind a at both rungs: within the margin, promoted with a; c, 1.0 behind, pauses."""
    rule = Guarded(min_steps=1, eta=3, max_steps=27, **NOISY)
    decisions = _feed(rule, {"a": [5.0, 4.1, 3.0], "b": [5.1, 4.2, 3.1], "c": [6.0, 5.1, 4.0]})
    assert decisions["c"] == "pause"
    assert _promotions(rule) == [("a", 3), ("b", 3)]
    strict = Guarded(min_steps=1, eta=3, max_steps=27)  # the default: no noise margin
    _feed(strict, {"a": [5.0, 4.1, 3.0], "b": [5.1, 4.2, 3.1], "c": [6.0, 5.1, 4.0]})
    assert _promotions(strict) == [("a", 3)]


def test_a_trial_catching_up_on_the_leader_goes_on() -> None:
    """Straight curves (σ = 0). c is 3.0 behind a at rung 1 and 1.1 at rung 3: it closed 1.9 in
    ln 3 of log-step, 1.73 per unit; carried over the ln 9 left to step 27 that is 3.80 more,
    so its projected gap is below zero: promoted. b fell further behind (0.5, then 1.0):
    paused. The ranking a < b < c holds at both rungs (settled). Without the projection c
    pauses too (and only a goes on)."""
    curves = {"a": [5.0, 4.0, 3.0], "b": [5.5, 4.75, 4.0], "c": [8.0, 6.05, 4.1]}
    rule = Guarded(min_steps=1, eta=3, max_steps=27)
    assert _feed(rule, curves) == {"a": "pause", "b": "pause", "c": "continue"}  # c at once
    assert rule.noise(3) == pytest.approx(0.0, abs=1e-9)
    assert _promotions(rule) == [("a", 3)]
    flat = Guarded(min_steps=1, eta=3, max_steps=27, project=0.0)
    assert _feed(flat, curves)["c"] == "pause"
    assert _promotions(flat) == [("a", 3)]


def test_waiting_trials_are_all_promoted_when_their_rung_can_gain_no_more() -> None:
    """Two trials at rung 3 (too few to measure the ranking): both wait, and when no trial can
    still reach the rung both go on, the better first."""
    rule = Guarded(min_steps=1, eta=3, max_steps=27)
    _feed(rule, {"a": [5.0, 4.0, 3.0], "b": [5.5, 4.6, 3.6]})
    assert rule.next_promotion() is None
    assert rule.next_promotion(final_below=3) == ("a", 3)
    assert rule.next_promotion(final_below=3) == ("b", 3)


def test_rank_correlations_and_noise_by_hand() -> None:
    # pairs (0,1) (0,2) (0,3) (1,3) (2,3) concordant, (1,2) discordant: τ = (5 - 1) / 6
    assert kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)
    # rank differences 0, 1, -1, 0: ρ = 1 - 6·2 / (4·15)
    assert spearman_rho([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert math.isnan(kendall_tau([1.0], [2.0])) and math.isnan(spearman_rho([1, 1, 1], [1, 2, 3]))
    # a straight line has no noise; ±e around one has second differences ±4e: σ = 4e/√6
    assert curve_noise([[(s, 5.0 - 0.1 * s) for s in range(6)]]) == pytest.approx(0.0, abs=1e-12)
    zigzag = [(s, 5.0 - 0.1 * s + 0.01 * (-1) ** s) for s in range(6)]
    assert curve_noise([zigzag]) == pytest.approx(0.04 / math.sqrt(6))
    assert curve_noise([[(1, 3.0), (2, 2.0)]]) == 0.0  # under three points: nothing to measure


def test_rank_correlations_agree_with_scipy() -> None:
    stats = pytest.importorskip("scipy.stats")
    xs, ys = [3.1, 2.0, 5.5, 4.0, 4.0, 1.2, 6.3], [2.2, 2.9, 5.0, 3.1, 4.4, 1.0, 4.4]
    assert kendall_tau(xs, ys) == pytest.approx(stats.kendalltau(xs, ys).statistic)
    assert spearman_rho(xs, ys) == pytest.approx(stats.spearmanr(xs, ys).statistic)


def test_rung_trust_worked_example() -> None:
    """Finished: t0, t1, t2 (finals 3.0, 3.2, 3.1: t0 < t2 < t1). At rung 1 their values order
    t1 < t2 < t0, the reverse: ρ = τ = -1. At rung 3 (3.6, 3.5, 3.8): t1 < t0 < t2; pairs
    (t0,t2) concordant, (t0,t1) and (t1,t2) discordant: τ = -1/3; ranks (1,0,2) against (0,2,1),
    Σd² = 6: ρ = 1 - 36/24 = -0.5. σ: second differences 0.8, 0.2 and 0 → median 0.2/√6, margin
    2·√2·σ = 0.231. t3 stopped at rung 1 1.02 behind the best there (4.0): not close; t4
    stopped at rung 3 0.2 behind the best there (3.5): within the noise."""
    curves = {
        "t0": [(1, 5.0), (3, 3.6), (9, 3.0)],
        "t1": [(1, 4.0), (3, 3.5), (9, 3.2)],
        "t2": [(1, 4.5), (3, 3.8), (9, 3.1)],
        "t3": [(1, 5.02)],
        "t4": [(1, 4.8), (3, 3.7)],
    }
    trust = rung_trust(curves, {"t0": 3.0, "t1": 3.2, "t2": 3.1}, {"t3": 1, "t4": 3}, [1, 3])
    assert trust["rungs"]["1"] == {"finished": 3, "spearman": -1.0, "kendall": -1.0}
    assert trust["rungs"]["3"] == {"finished": 3, "spearman": -0.5, "kendall": round(-1 / 3, 4)}
    assert trust["noise"] == pytest.approx(0.2 / math.sqrt(6), abs=1e-5)
    assert trust["stopped"] == 2 and trust["stopped_within_noise"] == 1
    # a maximised metric: the best is the largest value
    flipped = {t: [(s, -v) for s, v in c] for t, c in curves.items()}
    again = rung_trust(flipped, {"t0": -3.0, "t1": -3.2, "t2": -3.1}, {"t3": 1, "t4": 3}, [1, 3], "max")
    assert again["rungs"] == trust["rungs"] and again["stopped_within_noise"] == 1
