"""Deadline-aware reranking: score in request order while the next batch fits, keep the
retriever's order for the rest, and say so."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence

import grpc
import pytest
from forge.rerank.v1 import rerank_pb2, rerank_pb2_grpc

from forge_kit.cache import InMemoryCache
from forge_kit.grpckit import GrpcServer, make_channel
from forge_kit.testing.grpcserver import grpc_test_server
from forge_reranker.api import RerankerApi
from forge_reranker.config import RerankerSettings
from forge_reranker.service import Pace, PassageIn, RerankerService

TOKEN = "test-token"


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class MeteredScorer:
    """Scores a passage by the number in its text; each passage costs ``cost_s`` of the clock
    (advanced in place, or really slept when no clock is given)."""

    name = "metered"
    version = "1"
    batch_dependent = False

    def __init__(self, cost_s: float, clock: FakeClock | None = None) -> None:
        self.cost_s, self.clock = cost_s, clock
        self.calls: list[list[str]] = []

    def score(self, query: str, passages: Sequence[str]) -> list[float]:
        self.calls.append(list(passages))
        if self.clock is not None:
            self.clock.now += self.cost_s * len(passages)
        else:
            time.sleep(self.cost_s * len(passages))
        return [float(p.split()[-1]) for p in passages]


def passages(n: int) -> list[PassageIn]:
    # Retriever order p0..p{n-1}; the model likes later passages better (score = position).
    return [PassageIn(f"p{i}", f"passage {i}") for i in range(n)]


def settings(**values: object) -> RerankerSettings:
    return RerankerSettings(kafka_enabled=False, **values)  # type: ignore[arg-type]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


async def test_scores_in_request_order_until_the_deadline_then_keeps_retriever_order(
    clock: FakeClock,
) -> None:
    scorer = MeteredScorer(0.010, clock)
    service = RerankerService(
        scorer, InMemoryCache(), settings(cross_encoder_batch_size=2, deadline_margin_ms=0), clock=clock
    )
    await service.warm_up(2, "passage 0")
    assert service.pace.seconds_per_passage == pytest.approx(0.010)
    scorer.calls.clear()

    answer = await service.rerank("q", passages(8), 0, "", time_left_s=0.055)
    # 55 ms at 10 ms a passage: batches of 2, 2 and then the 1 that still fits.
    assert [len(c) for c in scorer.calls] == [2, 2, 1]
    assert answer.partial and answer.scored == 5
    assert [r.id for r in answer.passages] == ["p4", "p3", "p2", "p1", "p0", "p5", "p6", "p7"]
    assert [r.scored for r in answer.passages] == [True] * 5 + [False] * 3
    assert all(r.score == 0.0 for r in answer.passages[5:])


def test_a_pace_that_varies_plans_fewer_passages() -> None:
    steady, jumpy = Pace(), Pace()
    for seconds in (0.010, 0.010, 0.010, 0.010):
        steady.observe(1, seconds)
    for seconds in (0.010, 0.014, 0.006, 0.014):
        jumpy.observe(1, seconds)
    assert steady.deviation == 0.0 and steady.fitting(0.1) == 10
    # About the same mean, but batches have taken 40 % longer than it: keep room for that.
    assert jumpy.seconds_per_passage == pytest.approx(0.0106, abs=1e-3) and jumpy.deviation > 0.001
    assert jumpy.fitting(0.1) < 8


async def test_cached_scores_count_even_when_no_time_is_left(clock: FakeClock) -> None:
    scorer = MeteredScorer(0.010, clock)
    service = RerankerService(scorer, InMemoryCache(), settings(deadline_margin_ms=0), clock=clock)
    await service.rerank("q", passages(8)[6:], 0, "")  # p6 and p7 now cached
    scorer.calls.clear()
    answer = await service.rerank("q", passages(8), 3, "", time_left_s=0.0)
    assert scorer.calls == []
    assert answer.partial and answer.scored == 2
    assert [(r.id, r.scored) for r in answer.passages] == [("p7", True), ("p6", True), ("p0", False)]


async def test_without_a_deadline_everything_is_scored_in_one_call(clock: FakeClock) -> None:
    scorer = MeteredScorer(0.010, clock)
    service = RerankerService(scorer, InMemoryCache(), settings(cross_encoder_batch_size=2), clock=clock)
    answer = await service.rerank("q", passages(5), 0, "")
    assert [len(c) for c in scorer.calls] == [5]
    assert not answer.partial and answer.scored == 5
    assert [r.id for r in answer.passages] == ["p4", "p3", "p2", "p1", "p0"]


async def test_the_margin_is_kept_for_the_reply(clock: FakeClock) -> None:
    scorer = MeteredScorer(0.010, clock)
    service = RerankerService(
        scorer, InMemoryCache(), settings(cross_encoder_batch_size=4, deadline_margin_ms=30), clock=clock
    )
    await service.warm_up(1, "passage 0")
    answer = await service.rerank("q", passages(8), 0, "", time_left_s=0.055)
    assert answer.scored == 2  # 55 - 30 ms leaves room for two


async def test_a_partial_answer_blends_the_scored_passages_and_keeps_the_rest_in_order(
    clock: FakeClock,
) -> None:
    scorer = MeteredScorer(0.010, clock)
    service = RerankerService(
        scorer,
        InMemoryCache(),
        settings(cross_encoder_batch_size=2, deadline_margin_ms=0, retrieval_weight=0.5),
        clock=clock,
    )
    await service.warm_up(2, "passage 0")
    answer = await service.rerank(
        "q",
        [
            PassageIn(p.id, p.text, r)
            for p, r in zip(passages(6), [0.9, 0.8, 0.1, 0.0, 0.5, 0.4], strict=True)
        ],
        0,
        "",
        time_left_s=0.045,
    )
    # p0..p3 scored: model [0, 1/3, 2/3, 1], retrieval [1, 8/9, 1/9, 0] -> p1 first, as above
    assert answer.partial and answer.scored == 4
    assert [r.id for r in answer.passages] == ["p1", "p0", "p3", "p2", "p4", "p5"]
    assert [r.scored for r in answer.passages] == [True] * 4 + [False] * 2


@pytest.fixture
async def slow_stub() -> AsyncIterator[rerank_pb2_grpc.RerankerServiceStub]:
    service = RerankerService(
        # A margin for the reply that a loaded machine keeps (scoring a passage takes 50 ms).
        MeteredScorer(0.05),
        InMemoryCache(),
        settings(cross_encoder_batch_size=1, deadline_margin_ms=300),
    )
    await service.warm_up(1, "passage 0")
    server: GrpcServer
    async with (
        grpc_test_server(
            rerank_pb2_grpc.add_RerankerServiceServicer_to_server,
            RerankerApi(service),
            "forge.rerank.v1.RerankerService",
            token=TOKEN,
            service="reranker",
        ) as server,
        make_channel(f"127.0.0.1:{server.port}", token=TOKEN) as channel,
    ):
        yield rerank_pb2_grpc.RerankerServiceStub(channel)


@pytest.mark.integration
async def test_the_grpc_deadline_bounds_scoring_and_the_reply_says_so(
    slow_stub: rerank_pb2_grpc.RerankerServiceStub,
) -> None:
    request = rerank_pb2.RerankRequest(
        query="q", passages=[rerank_pb2.Passage(id=p.id, text=p.text) for p in passages(40)]
    )
    started = time.monotonic()
    reply = await slow_stub.Rerank(request, timeout=1.0)  # 40 passages would take 2 s
    assert time.monotonic() - started < 1.0
    assert reply.partial and 1 <= reply.scored < 40
    assert [r.scored for r in reply.results] == [True] * reply.scored + [False] * (40 - reply.scored)
    assert [r.index for r in reply.results[reply.scored :]] == list(range(reply.scored, 40))
    # Without a deadline the same call scores everything.
    full = await slow_stub.Rerank(request)
    assert not full.partial and full.scored == 40
    with pytest.raises(grpc.aio.AioRpcError):
        await slow_stub.Rerank(rerank_pb2.RerankRequest(query=""), timeout=1.0)
