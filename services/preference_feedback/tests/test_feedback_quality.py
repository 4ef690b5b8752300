"""Rater quality on synthetic raters whose behaviour is known."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest

from forge_preference_feedback.quality import (
    Label,
    QualityPolicy,
    assess_raters,
    cohen_kappa,
    dawid_skene,
    fleiss_kappa,
)

A, B, TIE, BAD = 0, 1, 2, 3


@pytest.mark.parametrize(
    ("first", "second", "expected"),
    [
        ([0, 1, 0, 1], [0, 1, 0, 1], 1.0),  # perfect agreement
        ([0, 1, 0, 1], [1, 0, 1, 0], -1.0),  # perfect disagreement on balanced labels
        ([0, 0, 1, 1], [0, 1, 0, 1], 0.0),  # exactly chance
        # Worked example (Wikipedia "Cohen's kappa"): 20 yes/yes, 5 yes/no, 10 no/yes, 15 no/no.
        ([1] * 25 + [0] * 25, [1] * 20 + [0] * 5 + [1] * 10 + [0] * 15, 0.4),
    ],
)
def test_cohen_kappa(first: list[int], second: list[int], expected: float) -> None:
    assert cohen_kappa(first, second) == pytest.approx(expected)


def test_cohen_kappa_needs_the_same_items() -> None:
    with pytest.raises(ValueError, match="same items"):
        cohen_kappa([0, 1], [0])
    assert math.isnan(cohen_kappa([0, 0], [0, 0]))  # chance agreement is 1: undefined


def _rows(table: list[list[int]]) -> list[Label]:
    """Labels from a Fleiss table: ``table[i][k]`` raters put item i in class k."""
    out = []
    for i, row in enumerate(table):
        rater = 0
        for k, n in enumerate(row):
            for _ in range(n):
                out.append(Label(f"i{i}", f"r{rater}", k))
                rater += 1
    return out


def test_fleiss_kappa_matches_the_textbook_example() -> None:
    # Fleiss (1971) as tabulated on Wikipedia: 10 items, 14 raters, 5 classes; kappa = 0.210.
    table = [
        [0, 0, 0, 0, 14],
        [0, 2, 6, 4, 2],
        [0, 0, 3, 5, 6],
        [0, 3, 9, 2, 0],
        [2, 2, 8, 1, 1],
        [7, 7, 0, 0, 0],
        [3, 2, 6, 3, 0],
        [2, 5, 3, 2, 2],
        [6, 5, 2, 1, 0],
        [0, 2, 2, 3, 7],
    ]
    assert fleiss_kappa(_rows(table), 5) == pytest.approx(0.210, abs=5e-4)


def test_labels_outside_the_classes_are_refused() -> None:
    with pytest.raises(ValueError, match="outside"):
        fleiss_kappa([Label("i", "r", 4)], 4)


@dataclass(frozen=True)
class Rater:
    """A synthetic rater: ``kind`` is honest (right with prob 1 - noise), flip (picks the other
    side), always_a, random_fast (random choices in about a second)."""

    name: str
    kind: str
    noise: float = 0.15


def simulate(
    raters: list[Rater], items: int, k: int, seed: int, gold_every: int = 10
) -> tuple[list[Label], dict[str, int], dict[str, int]]:
    """k distinct raters per item; truths are A or B; every ``gold_every``-th item is gold."""
    rng = random.Random(seed)
    truth = {f"item{i}": rng.choice([A, B]) for i in range(items)}
    labels = []
    for item, true in truth.items():
        for rater in rng.sample(raters, k):
            seconds = rng.uniform(6, 30)
            if rater.kind == "honest":
                label = true if rng.random() > rater.noise else rng.choice([1 - true, TIE, BAD])
            elif rater.kind == "flip":
                label = 1 - true if rng.random() > 0.1 else true
            elif rater.kind == "always_a":
                label = A
            else:
                label, seconds = rng.choice([A, B]), rng.uniform(0.5, 1.5)
            labels.append(Label(item, rater.name, label, seconds))
    gold = {item: t for n, (item, t) in enumerate(truth.items()) if n % gold_every == 0}
    return labels, truth, gold


POOLS = {
    "mostly honest": [Rater(f"h{i}", "honest") for i in range(16)]
    + [
        Rater("flip1", "flip"),
        Rater("flip2", "flip"),
        Rater("lazy", "always_a"),
        Rater("bot", "random_fast"),
    ],
    "noisy honest, more adversaries": [Rater(f"h{i}", "honest", noise=0.3) for i in range(14)]
    + [Rater(f"flip{i}", "flip") for i in range(4)]
    + [Rater("lazy1", "always_a"), Rater("lazy2", "always_a"), Rater("bot", "random_fast")],
}


@pytest.mark.parametrize("pool", sorted(POOLS))
# Eight draws of each pool: with 30 % noise an honest rater's kappa against the consensus lands
# near 0.2 on some draws (seed 6 of the noisy pool), which a point-value threshold flagged.
@pytest.mark.parametrize("seed", range(1, 9))
def test_simulated_pool_recovers_adversarial_raters(pool: str, seed: int) -> None:
    raters = POOLS[pool]
    labels, truth, gold = simulate(raters, items=300, k=5, seed=seed)
    report = assess_raters(labels, 4, gold)
    flagged = set(report.flagged())
    bad = {r.name for r in raters if r.kind != "honest"}
    precision = len(flagged & bad) / len(flagged)
    recall = len(flagged & bad) / len(bad)
    assert precision >= 0.9 and recall >= 0.9, report.flagged()
    # The consensus recovers the truth far better than any single honest rater's noise allows.
    right = sum(report.consensus[i] == t for i, t in truth.items()) / len(truth)
    assert right > 0.9
    reasons = report.flagged()
    for rater in raters:
        if rater.kind == "flip":
            assert any("anti-correlated" in r for r in reasons[rater.name])
        elif rater.kind == "always_a":
            assert any("same choice" in r for r in reasons[rater.name])
        elif rater.kind == "random_fast":
            assert any("too fast" in r for r in reasons[rater.name])
    by_name = {q.rater: q for q in report.raters}
    assert all(by_name[n].weight == 0.0 for n in bad)
    # Honest raters keep their Dawid–Skene accuracy as weight, far above chance (0.25 over four
    # choices): over these draws a 30 %-noise rater's estimate on ~70 items spans 0.46 to 0.8.
    assert all(by_name[r.name].weight > 0.4 for r in raters if r.kind == "honest")


def test_dawid_skene_learns_a_flipping_raters_confusion() -> None:
    raters = [Rater(f"h{i}", "honest", noise=0.1) for i in range(6)] + [Rater("flip", "flip")]
    labels, truth, _ = simulate(raters, items=200, k=7, seed=3)
    fit = dawid_skene(labels, 4)
    flip = fit.confusion["flip"]
    assert flip[A, B] > 0.8 and flip[B, A] > 0.8  # says B when the truth is A and vice versa
    assert fit.accuracy["flip"] < 0.2 < 0.8 < min(fit.accuracy[f"h{i}"] for i in range(6))
    assert sum(fit.consensus()[i] == t for i, t in truth.items()) / len(truth) > 0.97


def test_too_few_answers_flag_nobody_but_gold_failures_still_count() -> None:
    labels = [Label(f"i{n}", "new", A, 1.0) for n in range(5)] + [
        Label(f"i{n}", f"h{j}", B, 10.0) for n in range(5) for j in range(3)
    ]
    gold = {f"i{n}": B for n in range(5)}
    report = assess_raters(labels, 4, gold, QualityPolicy(min_answers=10, min_gold=5))
    assert report.flagged() == {"new": ["gold accuracy 0% on 5 gold items"]}
