"""Blending the cross-encoder's scores with the first stage's: min-max each, weighted sum."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from forge_kit.cache import InMemoryCache
from forge_reranker.config import RerankerSettings
from forge_reranker.service import PassageIn, RerankerService, blend


def test_blend_is_a_weighted_sum_of_min_max_normalised_scores() -> None:
    # model 0..1 after min-max: [0, 0.5, 1]; retrieval: [1, 0.5, 0]
    assert blend([2.0, 4.0, 6.0], [30.0, 20.0, 10.0], 0.25) == pytest.approx([0.25, 0.5, 0.75])
    assert blend([2.0, 4.0, 6.0], [30.0, 20.0, 10.0], 0.75) == pytest.approx([0.75, 0.5, 0.25])


def test_blend_keeps_the_model_scores_without_weight_or_without_every_retrieval_score() -> None:
    assert blend([3.0, -1.0], [0.1, 0.2], 0.0) == [3.0, -1.0]
    assert blend([3.0, -1.0], [0.1, None], 0.5) == [3.0, -1.0]
    assert blend([], [], 0.5) == []


def test_a_constant_list_counts_zero_so_the_other_decides() -> None:
    assert blend([1.0, 1.0, 1.0], [0.3, 0.1, 0.2], 0.5) == pytest.approx([0.5, 0.0, 0.25])
    assert blend([0.0, 2.0], [5.0, 5.0], 0.5) == pytest.approx([0.0, 0.5])


class PositionScorer:
    """Scores a passage by the number its text ends with."""

    name = "position"
    version = "1"
    batch_dependent = False

    def score(self, query: str, passages: Sequence[str]) -> list[float]:
        return [float(p.split()[-1]) for p in passages]


def metered(n: int, retrieval: list[float] | None) -> list[PassageIn]:
    # The model likes later passages better (score = position); the retriever sent them best first.
    return [PassageIn(f"p{i}", f"passage {i}", None if retrieval is None else retrieval[i]) for i in range(n)]


async def test_the_answer_follows_the_blend_and_keeps_the_model_score() -> None:
    retrieval = [1.0, 0.9, 0.2, 0.1]  # the first stage is sure of p0 and p1
    service = RerankerService(
        PositionScorer(), InMemoryCache(), RerankerSettings(kafka_enabled=False, retrieval_weight=0.5)
    )
    answer = await service.rerank("q", metered(4, retrieval), 0, "")
    # model [0, 1/3, 2/3, 1], retrieval [1, 8/9, 1/9, 0] -> [0.5, 0.61, 0.39, 0.5]; ties keep request order
    assert [r.id for r in answer.passages] == ["p1", "p0", "p3", "p2"]
    assert [r.model_score for r in answer.passages] == [1.0, 0.0, 3.0, 2.0]
    assert all(0.0 <= r.score <= 1.0 for r in answer.passages)
    # Without retrieval scores (or weight 0) the model alone decides, and score is its score.
    alone = await service.rerank("q", metered(4, None), 0, "")
    assert [r.id for r in alone.passages] == ["p3", "p2", "p1", "p0"]
    assert (
        [r.score for r in alone.passages] == [r.model_score for r in alone.passages] == [3.0, 2.0, 1.0, 0.0]
    )
