"""The guarded rule (ASHA's promotion form on complete rungs, hedged by the learning-rate front)
and the rungs' trust report, against hand-worked examples."""

from __future__ import annotations

import math

import pytest

from forge_experiments.earlystop import Guarded, default_min_steps
from forge_experiments.rungtrust import curve_noise, kendall_tau, rung_trust, spearman_rho

#: Rungs 1, 3, 9 of 27 steps.
RULE = {"min_steps": 1, "eta": 3, "max_steps": 27}


def _rule(rates: dict[str, float] | None = None, **settings: object) -> Guarded:
    rule = Guarded(**RULE, **settings)  # type: ignore[arg-type]
    for trial, rate in (rates or {}).items():
        rule.describe(trial, {"optim.lr": rate, "model.hidden_size": 64})
    return rule


def _to_rung(rule: Guarded, values: dict[str, tuple[float, float]], order: list[str]) -> dict[str, str]:
    """Each trial in ``order`` reports (rung 1, rung 3) values; the decisions at rung 3."""
    out = {}
    for trial in order:
        assert rule.report(trial, 1, values[trial][0]) == "continue"  # the first rung: all go on
        assert rule.report(trial, 2, values[trial][0]) == "ignore"  # not a rung
        out[trial] = rule.report(trial, 3, values[trial][1])
    return out


def _promotions(rule: Guarded, final_below: int = 0) -> list[tuple[str, int]]:
    out = []
    while (found := rule.next_promotion(final_below)) is not None:
        out.append(found)
    return out


def test_default_rungs_are_a_27th_a_9th_and_a_third_of_the_budget() -> None:
    assert default_min_steps(243) == 9 and default_min_steps(20) == 1
    assert Guarded(min_steps=default_min_steps(243), eta=3, max_steps=243).rungs == [9, 27, 81]


#: Three rates, two trials each (values at rungs 1 and 3). At rung 3 the highest rate leads, as
#: a short horizon has it: a, b (rate 0.009) 4.0 and 4.12; c, d (0.003) 4.2, 4.28; e, f (0.001)
#: 4.5, 4.6. The rate front, lowest rate first: e (best of 0.001), c (4.2 beats every lower
#: rate's 4.5), a (4.0). The top 6 // 3 = 2 past the leader a: the one trial least behind a trial
#: of no larger rate, d (0.08 behind c; b is 0.12 behind a, f 0.1 behind e). So a, c, d, e go
#: on, b and f wait (by value the top two would be a and b: ``runners="value"``).
SIX = {"a": (5.0, 4.0), "b": (5.1, 4.12), "c": (5.2, 4.2), "d": (5.3, 4.28), "e": (5.4, 4.5), "f": (5.5, 4.6)}
RATES = {"a": 0.009, "b": 0.009, "c": 0.003, "d": 0.003, "e": 0.001, "f": 0.001}


def test_a_rung_keeps_its_rate_front_and_the_runners_up_least_behind_a_trial_of_no_larger_rate() -> None:
    rule = _rule(RATES)
    assert set(_to_rung(rule, SIX, list(SIX)).values()) == {"pause"}  # rung 3 is not complete yet
    assert _promotions(rule) == []  # nothing is promoted before the rung is complete
    assert rule.front(3) == ["e", "c", "a"]
    assert rule.deficit("d", 3) == pytest.approx(0.08) and rule.deficit("a", 3) == pytest.approx(-0.12)
    assert _promotions(rule, final_below=3) == [("a", 3), ("c", 3), ("d", 3), ("e", 3)]
    by_value = _rule(RATES, runners="value")
    _to_rung(by_value, SIX, list(SIX))
    assert _promotions(by_value, final_below=3) == [("a", 3), ("b", 3), ("c", 3), ("e", 3)]


def test_a_trial_beaten_by_a_lower_rate_is_off_the_front() -> None:
    """The 0.009 trials fall behind the best 0.003 one (4.25, 4.3 against 4.2): the front is e, c;
    the one place past the leader goes to a (0.05 behind c; d 0.08, b 0.1, f 0.1): a, c, e go on."""
    values = {**SIX, "a": (5.0, 4.25), "b": (5.1, 4.3)}
    rule = _rule(RATES)
    _to_rung(rule, values, list(values))
    assert rule.front(3) == ["e", "c"]
    assert {t for t, _ in _promotions(rule, final_below=3)} == {"c", "a", "e"}


def test_what_a_rung_promotes_does_not_depend_on_the_order_the_trials_arrived_in() -> None:
    """The same values in three arrival orders: the same trials promoted, in the same order, with
    rates and without. (The catch-up guard of the earlier rule judged each arrival against the
    leader of the moment: on these values it promoted a, b in the first order and a, b, c, d,
    each at once, in the reverse one.)"""
    for rates in (None, RATES):
        results = []
        for order in (list(SIX), list(reversed(SIX)), ["c", "e", "a", "f", "b", "d"]):
            rule = _rule(rates)
            decisions = _to_rung(rule, SIX, order)
            results.append((decisions, _promotions(rule, final_below=3)))
        assert all(r == results[0] for r in results)
        assert all(d == "pause" for d in results[0][0].values())


def test_the_last_rung_adds_one_rate_down_from_its_leader() -> None:
    """At rung 9 (the last) four trials: a (0.009) leads at 3.0; c (0.003) 3.1, e (0.001) 3.2 and
    g (0.027) 3.3. Top 4 // 3 = 1: a. ``next`` adds the front's next lower rate, c (not e, two
    rates down, nor g, above the leader); ``front`` adds c and e; ``none`` nothing."""
    rates = {"a": 0.009, "c": 0.003, "e": 0.001, "g": 0.027}
    last = {"a": 3.0, "c": 3.1, "e": 3.2, "g": 3.3}
    promoted = {}
    for setting in ("next", "front", "none"):
        rule = _rule(rates, last=setting)
        for trial in rates:
            rule.report(trial, 1, 5.0)
        for trial in rates:
            rule.report(trial, 3, 4.0 + rates[trial])
        _promotions(rule, final_below=3)  # rung 3 (4 trials: top 1, front a, c, e): a, c, e
        for trial in ("a", "c", "e"):
            assert rule.report(trial, 9, last[trial]) == "pause"
        rule.report("g", 9, last["g"])  # g has no promotion out of rung 3: a coarse late report
        promoted[setting] = [t for t, r in _promotions(rule, final_below=9) if r == 9]
    assert promoted == {"next": ["a", "c"], "front": ["a", "c", "e"], "none": ["a"]}


def _sequential(rule: Guarded, at_last: dict[str, float]) -> list[str]:
    """The bench's scheduler at concurrency 1 once nothing is left to start: a free slot asks
    ``next_promotion`` with nothing in flight (``final_below`` the full budget), and the trial it
    resumes runs to its next rung (the last, 9), pausing there, before the slot asks again.
    Returns the trials promoted out of rung 9 (they run to the full budget)."""
    finished = []
    while (found := rule.next_promotion(final_below=27)) is not None:
        trial, rung = found
        if rung == 9:
            finished.append(trial)
        else:
            assert rule.report(trial, 9, at_last[trial]) == "pause"
    return finished


def test_the_last_rung_decides_once_on_every_trial_that_can_reach_it() -> None:
    """Rung 3 promotes a, c, d, e (SIX). At rung 9: c 3.0, a 3.1, d 3.2, e 3.3. Decided on all
    four: the top 4 // 3 = 1 (c) and the front's next rate below c's (e): two finishers, the
    bound ``n // eta + 1``. The earlier rule served the highest rung first and called rung 9
    complete with nothing in flight, so it promoted a alone at rung 9 (the top of one), then c
    (the top of three), then e: three finishers, the union of partial decisions."""
    at_last = {"a": 3.1, "b": 3.25, "c": 3.0, "d": 3.2, "e": 3.3, "f": 3.4}
    rule = _rule(RATES)
    _to_rung(rule, SIX, list(SIX))
    finished = _sequential(rule, at_last)
    assert finished == ["c", "e"]
    assert len(finished) <= rule.occupancy()[9] // 3 + 1
    # the same as a decision on the complete rung, whatever the order the trials arrived in
    again = _rule(RATES)
    _to_rung(again, SIX, list(reversed(SIX)))
    for trial, _ in _promotions(again, final_below=3):
        again.report(trial, 9, at_last[trial])
    assert [t for t, _ in _promotions(again, final_below=27)] == ["c", "e"]


def test_a_rung_waits_for_the_trials_promoted_towards_it() -> None:
    """Rung 3 has promoted a, c, d, e and none has reported at 9 yet (a caller may ask before it
    has started them); g, never promoted out of rung 3, reports at 9. Nothing is in flight from
    the caller's view (``final_below`` 27), yet rung 9 is not complete: four trials are on their
    way there. Once they arrive it decides on all five."""
    rule = _rule({**RATES, "g": 0.027})
    _to_rung(rule, SIX, list(SIX))
    assert [t for t, _ in _promotions(rule, final_below=27)] == ["a", "c", "d", "e"]
    rule.report("g", 1, 5.0)
    assert rule.report("g", 9, 2.9) == "pause"
    assert rule.arriving(9) and not rule.arriving(3)
    assert rule.next_promotion(final_below=27) is None
    for trial, value in {"a": 3.1, "c": 3.2, "d": 3.0, "e": 3.3}.items():
        rule.report(trial, 9, value)
    assert not rule.arriving(9)
    # top 5 // 3 = 1 (g) and the front's next rate below g's 0.027: d (0.003, 3.0; a, 0.009, is
    # behind it)
    assert [t for t, _ in _promotions(rule, final_below=27)] == ["g", "d"]


#: Six rates × Adam β2 (0.95, 0.999) under a warmup-stable-decay schedule: each trial's rate and
#: its values at rungs 3 and 9 of 27 (the cooldown values of ``family-s1-2`` at rungs 27 and 81 of
#: 243, rounded) and at the end. The highest rates lead at rung 3; t5 (rate 0.00118, β2 0.999)
#: is 0.0053 behind t4, its own rate's other trial, there, leads at rung 9 and ends best.
BETA2 = {
    "t0": (0.000317, 5.4957, 4.9757, 4.0913),
    "t1": (0.000317, 5.4789, 4.9889, 4.0810),
    "t2": (0.000611, 5.2800, 4.6321, 3.8395),
    "t3": (0.000611, 5.2772, 4.6350, 3.8217),
    "t4": (0.00118, 5.2044, 4.3726, 3.6968),
    "t5": (0.00118, 5.2097, 4.3280, 3.6726),
    "t6": (0.00227, 5.1490, 4.4092, 3.9637),
    "t7": (0.00227, 5.1555, 4.4129, 3.9479),
    "t8": (0.00437, 5.0288, 4.4281, 4.0650),
    "t9": (0.00437, 5.0146, 4.4749, 4.1249),
    "t10": (0.00841, 5.1446, 4.7526, 4.1881),
    "t11": (0.00841, 5.0901, 4.6967, 4.3445),
}


def _finishers(rule: Guarded) -> tuple[set[str], list[str]]:
    """BETA2 through rungs 1, 3 and 9: the trials past rung 3 and those promoted out of rung 9."""
    for trial, (rate, _, _, _) in BETA2.items():
        rule.describe(trial, {"optim.lr": rate})
        assert rule.report(trial, 1, 6.0) == "continue"
    for trial, (_, third, _, _) in BETA2.items():
        rule.report(trial, 3, third)
    past = {t for t, _ in _promotions(rule, final_below=3)}
    for trial in past:
        rule.report(trial, 9, BETA2[trial][2])
    return past, [t for t, _ in _promotions(rule, final_below=27)]


def test_a_runner_up_close_behind_its_own_rate_goes_on_in_place_of_a_high_rates_second() -> None:
    """Rung 3 (12 trials): the front is t1, t3, t4, t6, t9 (the best of each rate ahead of every
    lower rate). ASHA's top four by value are t9, t8, t11, t10, the two highest rates' trials,
    whose lead is the short horizon's; by deficit the three places past the leader go to t2
    (0.0028 behind t3), t5 (0.0053 behind t4) and t7 (0.0065 behind t6): 8 trials go on, the cap
    12 - 4. At rung 9 (8 trials) t5 leads: it and the front's next rate below (t2), and the one
    place by deficit off the front (t3, 0.0029 behind t2), run to the end. By value, t5 never
    passes rung 3 and the best finisher is t4, 0.024 behind t5 at the end."""
    past, finished = _finishers(_rule())
    assert past == {"t1", "t3", "t4", "t6", "t9", "t2", "t5", "t7"}
    assert finished == ["t5", "t2", "t3"]
    best = min(BETA2, key=lambda t: BETA2[t][3])
    assert best == "t5" and best in finished
    by_value = _rule(runners="value")
    past, finished = _finishers(by_value)
    assert "t5" not in past and min(BETA2[t][3] for t in finished) - BETA2[best][3] > 0.02
    assert len(past) == 8 and len(finished) == 3  # the same compute: the places went elsewhere


def test_a_rung_before_the_last_stops_at_least_a_third_whatever_the_front() -> None:
    """Twelve rates, one trial each, the higher rate ahead at rung 3 (as a short horizon has it):
    every trial is on the rate front. At most 12 - 12 // 3 = 8 go on, the best eight (the rates
    nearest the leader's); the last rung then runs at most 8 // 3 + 1 = 3 to the end."""
    rule = _rule()
    for i in range(12):
        rule.describe(f"r{i:02d}", {"optim.lr": 0.001 * (i + 1)})
        rule.report(f"r{i:02d}", 1, 6.0)
    for i in range(12):
        rule.report(f"r{i:02d}", 3, 5.0 - 0.01 * i)
    assert len(rule.front(3)) == 12
    past = [t for t, _ in _promotions(rule, final_below=3)]
    assert sorted(past) == [f"r{i:02d}" for i in range(4, 12)]
    for trial in past:
        rule.report(trial, 9, 4.0 + 0.01 * int(trial[1:]))  # the lower rate ahead now
    assert len(_promotions(rule, final_below=27)) <= 3


def test_trials_of_no_known_rate_are_one_group_ranked_as_asha_ranks_them() -> None:
    rule = _rule()
    _to_rung(rule, SIX, list(SIX))
    assert rule.front(3) == ["a"] and _promotions(rule, final_below=3) == [("a", 3), ("b", 3)]


def test_a_catching_up_trial_goes_on_at_the_last_rung_under_catchup() -> None:
    """Rungs 1, 3 of 9 (3 is the last). c (rate 0.001) is 3.0 behind a (0.003) at rung 1 and 1.1
    at rung 3: it closed 1.9 in ln 3 of log-step; carried over the ln 3 left to step 9 that is
    1.9 more, so its projected gap is below zero: promoted. b (0.001, a second trial of c's rate)
    is off the front."""
    rule = Guarded(min_steps=1, eta=3, max_steps=9, last="catchup")
    for trial, rate in {"a": 0.003, "b": 0.001, "c": 0.001}.items():
        rule.describe(trial, {"optim.lr": rate})
    for trial, (first, third) in {"a": (5.0, 3.0), "b": (5.5, 4.3), "c": (8.0, 4.1)}.items():
        rule.report(trial, 1, first)
        rule.report(trial, 3, third)
    assert _promotions(rule, final_below=3) == [("a", 3), ("c", 3)]
    plain = Guarded(min_steps=1, eta=3, max_steps=9, last="none")
    for trial, (first, third) in {"a": (5.0, 3.0), "b": (5.5, 4.3), "c": (8.0, 4.1)}.items():
        plain.report(trial, 1, first)
        plain.report(trial, 3, third)
    assert _promotions(plain, final_below=3) == [("a", 3)]


def test_a_maximised_metric_and_a_diverged_trial() -> None:
    """Accuracy (max): the front keeps the most accurate of each rate ahead of all lower rates; b
    diverged (NaN) and ranks last; the place past the leader goes to d: a, c, d, e go on."""
    rule = _rule(RATES, mode="max")
    values = {t: (-v1, -v3) for t, (v1, v3) in SIX.items()}
    values["b"] = (-5.1, math.nan)
    _to_rung(rule, values, list(values))
    assert rule.front(3) == ["e", "c", "a"]
    assert [t for t, _ in _promotions(rule, final_below=3)] == ["a", "c", "d", "e"]


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
