from __future__ import annotations

from collections.abc import Sequence

import pytest

from forge_kit.cache import InMemoryCache
from forge_reranker.config import RerankerSettings
from forge_reranker.scoring import LexicalScorer
from forge_reranker.service import PassageIn, RerankerService


class CountingScorer(LexicalScorer):
    """The real lexical scorer, recording which passages it was asked to score."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[list[str]] = []

    def score(self, query: str, passages: Sequence[str]) -> list[float]:
        self.calls.append(list(passages))
        return super().score(query, passages)


@pytest.fixture
def settings() -> RerankerSettings:
    return RerankerSettings(kafka_enabled=False, max_passages=8, max_query_chars=200, max_passage_chars=500)


@pytest.fixture
def scorer() -> CountingScorer:
    return CountingScorer()


@pytest.fixture
def service(scorer: CountingScorer, settings: RerankerSettings) -> RerankerService:
    return RerankerService(scorer, InMemoryCache(), settings)


@pytest.fixture
def passages() -> list[PassageIn]:
    """Candidates for "tumor suppressor in glioblastoma"; only p2 answers it."""
    return [
        PassageIn("p0", "Glioblastoma is the most common malignant brain tumor in adults."),
        PassageIn("p1", "The weather in the alps was sunny for most of the summer."),
        PassageIn("p2", "TNFAIP3 acts as a tumor suppressor in glioblastoma and its loss promotes growth."),
        PassageIn("p3", "A suppressor of cytokine signalling regulates tumor immunity in melanoma."),
    ]
