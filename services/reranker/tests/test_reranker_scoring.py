"""The lexical scorer: BM25 over the call's passages plus the phrase bonus."""

from __future__ import annotations

import math

import pytest

from forge_reranker.scoring import LexicalScorer, tokenize


def test_relevant_passage_ranks_first() -> None:
    passages = [
        "Glioblastoma is the most common malignant brain tumor in adults.",
        "The weather in the alps was sunny for most of the summer.",
        "TNFAIP3 acts as a tumor suppressor in glioblastoma and its loss promotes growth.",
        "A suppressor of cytokine signalling regulates tumor immunity in melanoma.",
    ]
    scores = LexicalScorer().score("TNFAIP3 is a tumor suppressor in glioblastoma.", passages)
    assert max(range(4), key=scores.__getitem__) == 2
    assert scores[1] == min(scores)


def test_bm25_matches_the_formula_without_bonus() -> None:
    scorer = LexicalScorer(k1=1.2, b=0.75, phrase_bonus=0.0)
    docs = ["cell cell growth", "growth factor", "unrelated words here"]
    scores = scorer.score("cell", docs)
    avg = (3 + 2 + 3) / 3
    idf = math.log(1 + (3 - 1 + 0.5) / (1 + 0.5))
    assert scores[0] == pytest.approx(idf * 2 * 2.2 / (2 + 1.2 * (0.25 + 0.75 * 3 / avg)))
    assert scores[1:] == [0.0, 0.0]


def test_rare_terms_weigh_more_than_common_ones() -> None:
    scorer = LexicalScorer(phrase_bonus=0.0)
    docs = ["protein binding protein", "protein kinase", "protein folding", "protein actin"]
    scores = scorer.score("protein kinase", docs)
    assert scores[1] == max(scores)


def test_exact_phrase_earns_the_bonus() -> None:
    scorer = LexicalScorer(phrase_bonus=2.0)
    docs = ["stem cell therapy works", "therapy with a stem and a cell"]
    with_bonus = scorer.score("stem cell therapy", docs)
    without = LexicalScorer(phrase_bonus=0.0).score("stem cell therapy", docs)
    assert with_bonus[0] - without[0] == pytest.approx(2.0)
    assert with_bonus[1] == pytest.approx(without[1])  # no adjacent query pair at all
    partial = scorer.score("stem cell therapy", ["stem cell and a therapy", "therapy with a stem and a cell"])
    partial_without = LexicalScorer(phrase_bonus=0.0).score(
        "stem cell therapy", ["stem cell and a therapy", "therapy with a stem and a cell"]
    )
    assert partial[0] - partial_without[0] == pytest.approx(2.0 * 0.5 * 1 / 2)


def test_degenerate_inputs() -> None:
    scorer = LexicalScorer()
    assert scorer.score("query", []) == []
    assert scorer.score("!!!", ["some text"]) == [0.0]
    assert tokenize("Tumor-Suppressor, P53!") == ["tumor", "suppressor", "p53"]


def test_version_follows_parameters() -> None:
    assert LexicalScorer().version == LexicalScorer().version
    assert LexicalScorer(k1=1.5).version != LexicalScorer().version
    assert LexicalScorer(phrase_bonus=0.5).version != LexicalScorer().version
