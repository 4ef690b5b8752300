"""VLM metrics: exact match, BLEU-4 and the per-type breakdown."""

from __future__ import annotations

import math

import pytest

from forge_training.vlm import metrics


def test_exact_match_normalises_case_punctuation_and_articles() -> None:
    assert metrics.exact_match("The Red.", "red") == 1.0
    assert metrics.exact_match(" top  left!", "top left") == 1.0
    assert metrics.exact_match("top right", "top left") == 0.0
    assert metrics.exact_match("", "red") == 0.0


def test_vqa_accuracy_with_its_wilson_interval() -> None:
    acc, (low, high) = metrics.vqa_accuracy(["red", "blue", "two", "x"], ["red", "blue", "two", "y"])
    assert acc == 0.75 and 0.0 < low < 0.75 < high < 1.0
    assert math.isnan(metrics.vqa_accuracy([], [])[0])
    with pytest.raises(ValueError, match="2 predictions for 1 references"):
        metrics.exact_matches(["a", "b"], ["a"])


def test_bleu4_known_values() -> None:
    ref = "two shapes: a big red circle in the top left, a small blue square in the bottom right."
    assert metrics.bleu4([ref], [ref]) == pytest.approx(1.0)
    assert metrics.bleu4(["green"], [ref]) == 0.0
    # One wrong word: 1-gram precision 16/17, and fewer matching higher-order n-grams.
    worse = ref.replace("blue", "green")
    score = metrics.bleu4([worse], [ref])
    assert 0.5 < score < 1.0
    # Hand count: candidate "w x y z" vs reference "w x y z v": precisions 1, BP = exp(1 - 5/4).
    assert metrics.bleu4(["w x y z"], ["w x y z v"]) == pytest.approx(math.exp(1 - 5 / 4))
    # Clipping: a repeated word counts at most as often as in the reference.
    assert metrics.bleu4(["red red red red"], ["red circle"]) == 0.0


def test_sentence_bleu4_smooths_higher_orders() -> None:
    assert metrics.sentence_bleu4("red circle", "a red circle in the top left") > 0.0
    assert metrics.sentence_bleu4("green", "red circle") == 0.0
    assert metrics.sentence_bleu4("red circle top", "red circle top") == pytest.approx(1.0)


def test_accuracy_by_group() -> None:
    assert metrics.accuracy_by(["colour", "count", "colour"], [1.0, 0.0, 0.0]) == {
        "colour": 0.5,
        "count": 0.0,
    }
