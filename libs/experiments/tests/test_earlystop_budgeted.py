"""The budgeted rule (the guarded rule's complete rungs with a scale-free margin and finishers
within a budget of trial-steps), against hand-worked examples."""

from __future__ import annotations

import math

import pytest

from forge_experiments.earlystop import Asha, AshaPromotion, Budgeted, Guarded, MedianStopping, build

#: Three rates, two trials each, values at rungs 1 and 3 of 27 steps (rungs 1, 3, 9). Deficits at
#: rung 3 (behind the best other trial of no larger rate): a -0.12, b 0.12 (behind a), c -0.08,
#: d 0.08 (behind c), e -0.1, f 0.1 (behind e). Non-negative ones: 0.08, 0.1, 0.12, median 0.1.
SIX = {"a": (5.0, 4.0), "b": (5.1, 4.12), "c": (5.2, 4.2), "d": (5.3, 4.28), "e": (5.4, 4.5), "f": (5.5, 4.6)}
RATES = {"a": 0.009, "b": 0.009, "c": 0.003, "d": 0.003, "e": 0.001, "f": 0.001}


def _rule(**settings: object) -> Budgeted:
    rule = Budgeted(min_steps=1, eta=3, max_steps=27, **settings)  # type: ignore[arg-type]
    for trial, rate in RATES.items():
        rule.describe(trial, {"optim.lr": rate})
    for trial, (first, second) in SIX.items():
        assert rule.report(trial, 1, first) == "continue"  # the first rung: all go on
        assert rule.report(trial, 3, second) == "pause"  # rung 3 decides once complete
    return rule


def _promoted(rule: Budgeted, final_below: int) -> list[str]:
    out = []
    while (found := rule.next_promotion(final_below)) is not None:
        out.append(found[0])
    return out


def test_a_rung_before_the_last_stops_only_trials_behind_by_more_than_the_margin() -> None:
    """``margin_k`` 3: margin 0.3, every trial goes on (ASHA would stop two thirds); ``margin_k``
    1.1: margin 0.11, b (0.12 behind a, a trial of its own rate) stops, d and f go on."""
    wide = _rule()
    assert wide.margin(3) == pytest.approx(0.3)
    assert sorted(_promoted(wide, final_below=3)) == sorted(SIX)
    narrow = _rule(margin_k=1.1)
    assert narrow.margin(3) == pytest.approx(0.11)
    assert sorted(_promoted(narrow, final_below=3)) == ["a", "c", "d", "e", "f"]
    assert _rule().margin(1) == pytest.approx(3 * 0.1)  # rung 1 values are spread alike


def test_the_last_rung_finishes_what_the_budget_leaves_ranked_by_projection() -> None:
    """After rung 3 (margin_k 1.1: b stopped), five trials report at rung 9. Spent: b 3 + 1,
    the others 9 + 1 each: 54 of the grid's 6 × 27 = 162. ``budget`` 0.7 leaves 113.4 - 54 = 59.4,
    three finishers of 18 steps each. Projected to step 27 (straight in log step from rung 3:
    ``2 · v9 - v3``): c 3.1, d 3.12, e 3.14, a 3.2, f 3.3, so c, d and e finish although a leads
    at rung 9 (3.6): a has flattened out, the lower rates are still gaining."""
    at_last = {"a": 3.6, "c": 3.65, "d": 3.7, "e": 3.82, "f": 3.95}
    rule = _rule(margin_k=1.1, budget=0.7)
    for trial in _promoted(rule, final_below=3):
        assert rule.report(trial, 9, at_last[trial]) == "pause"
    assert rule.spent() == 54 and rule.finishers(9) == 3
    assert rule.projected("f", 9) == pytest.approx(3.3)
    assert _promoted(rule, final_below=27) == ["c", "d", "e"]
    # the default budget (half the grid's steps) leaves 27: one finisher, the best projected
    again = _rule(margin_k=1.1)
    for trial in _promoted(again, final_below=3):
        again.report(trial, 9, at_last[trial])
    assert again.finishers(9) == 1 and _promoted(again, final_below=27) == ["c"]


def test_cooldown_branches_count_against_the_budget() -> None:
    """A branch of half the rung: ``ceil(0.5)``, ``ceil(1.5)``, ``ceil(4.5)`` = 1, 2, 5 more steps
    for a trial at rung 9 (its 9 + 1 as before): 18 in all."""
    rule = Budgeted(min_steps=1, eta=3, max_steps=27, branch=0.5)
    rule.report("t", 1, 5.0)
    assert rule.spent() == 2 + 1
    rule.next_promotion(final_below=0)  # the first rung promotes at once
    rule.report("t", 3, 4.0)
    rule.report("t", 9, 3.0)
    assert rule.spent() == 10 + 1 + 2 + 5


def test_a_maximised_metric_and_a_diverged_trial() -> None:
    """Under ``max`` the deficit and the projection flip sign; a NaN ranks last and never
    finishes while a finite trial is there to take its place."""
    rule = Budgeted(min_steps=1, eta=3, max_steps=27, mode="max", budget=1.0)
    for trial, value in {"x": 0.5, "y": 0.4, "z": math.nan}.items():
        rule.report(trial, 1, value)
        rule.report(trial, 3, value + 0.1)
    assert rule.deficit("y", 3) == pytest.approx(0.1)
    kept = _promoted(rule, final_below=3)
    assert "z" not in kept and sorted(kept) == ["x", "y"]


def test_build_names_every_rule_and_refuses_bad_settings() -> None:
    assert type(build("budgeted", 9, 3, 243, branch=0.1)) is Budgeted
    assert type(build("guarded", 9, 3, 243)) is Guarded
    assert type(build("asha", 9, 3, 243)) is AshaPromotion
    assert type(build("asha", 9, 3, 243, form="stopping")) is Asha
    assert type(build("median", 9, 3, 243)) is MedianStopping
    assert build("none", 1, 3, 243) is None
    with pytest.raises(ValueError, match="unknown"):
        build("hyperband", 9, 3, 243)
    for bad in ({"budget": 0.0}, {"budget": 1.5}, {"margin_k": 0.0}, {"branch": -0.1}):
        with pytest.raises(ValueError):
            Budgeted(min_steps=9, eta=3, max_steps=243, **bad)  # type: ignore[arg-type]
