"""RerankerService: ordering, top_n, validation and the score cache (in-process backend)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from forge_kit import errors
from forge_kit.cache import InMemoryCache
from forge_reranker.config import RerankerSettings
from forge_reranker.service import PassageIn, Reranked, RerankerService

if TYPE_CHECKING:
    from conftest import CountingScorer

QUERY = "TNFAIP3 is a tumor suppressor in glioblastoma."


async def test_orders_best_first_and_cuts_to_top_n(
    service: RerankerService, passages: list[PassageIn]
) -> None:
    ranked = (await service.rerank(QUERY, passages, top_n=2, model="")).passages
    assert [r.id for r in ranked] == ["p2", "p0"]
    assert ranked[0].index == 2 and ranked[0].score > ranked[1].score
    everything = (await service.rerank(QUERY, passages, top_n=0, model="bm25-phrase")).passages
    assert [r.id for r in everything][:2] == ["p2", "p0"] and len(everything) == 4
    assert everything[-1].id == "p1"


async def test_ties_keep_request_order(service: RerankerService) -> None:
    same = [PassageIn(f"p{i}", "identical text about nothing") for i in range(3)]
    assert [r.index for r in (await service.rerank("query", same, 0, "")).passages] == [0, 1, 2]


async def test_no_passages_is_an_empty_answer(service: RerankerService) -> None:
    assert await service.rerank("query", [], 0, "") == Reranked([], 0, False)


async def test_repeated_call_is_served_from_the_cache(
    service: RerankerService, scorer: CountingScorer, passages: list[PassageIn]
) -> None:
    first = (await service.rerank(QUERY, passages, 0, "")).passages
    second = (await service.rerank(QUERY, list(reversed(passages)), 0, "")).passages
    assert len(scorer.calls) == 1
    assert {r.id: r.score for r in first} == {r.id: r.score for r in second}
    # The lexical scorer is batch-dependent: another passage set is scored afresh, never mixed.
    await service.rerank(QUERY, passages[:3], 0, "")
    assert len(scorer.calls) == 2 and len(scorer.calls[1]) == 3
    await service.rerank("another query", passages, 0, "")
    assert len(scorer.calls) == 3


async def test_broken_cache_does_not_fail_the_call(
    scorer: CountingScorer, settings: RerankerSettings, passages: list[PassageIn]
) -> None:
    class BrokenCache(InMemoryCache):
        async def get(self, key: str) -> bytes | None:
            raise ConnectionError("redis down")

        async def set(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
            raise ConnectionError("redis down")

    service = RerankerService(scorer, BrokenCache(), settings)
    assert (await service.rerank(QUERY, passages, 1, "")).passages[0].id == "p2"


@pytest.mark.parametrize(
    ("query", "passages", "top_n", "model", "field"),
    [
        ("", [PassageIn("a", "x")], 0, "", "query"),
        ("q" * 201, [PassageIn("a", "x")], 0, "", "query"),
        ("q", [PassageIn("a", "x")] * 9, 0, "", "passages"),
        ("q", [PassageIn("a", "x")], 9, "", "top_n"),
        ("q", [PassageIn("a", "x"), PassageIn("b", " ")], 0, "", "passages[1].text"),
        ("q", [PassageIn("a", "x" * 501)], 0, "", "passages[0].text"),
        ("q", [PassageIn("a", "x")], 0, "ms-marco-MiniLM", "model"),
    ],
)
async def test_bad_input_names_the_field(
    service: RerankerService, query: str, passages: list[PassageIn], top_n: int, model: str, field: str
) -> None:
    with pytest.raises(errors.ValidationError) as caught:
        await service.rerank(query, passages, top_n, model)
    assert caught.value.field == field
