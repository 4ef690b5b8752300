"""The reranker's gRPC surface on a real server; the score cache on the real Redis."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc
import pytest
from forge.rerank.v1 import rerank_pb2, rerank_pb2_grpc

from forge_kit.cache import make_cache
from forge_kit.grpckit import FIELD_METADATA_KEY, GrpcServer, check_health, make_channel
from forge_kit.testing.grpcserver import grpc_test_server
from forge_reranker.api import RerankerApi
from forge_reranker.config import RerankerSettings
from forge_reranker.service import PassageIn, RerankerService, blend

if TYPE_CHECKING:
    from conftest import CountingScorer

pytestmark = [pytest.mark.asyncio, pytest.mark.integration]
TOKEN = "test-token"
QUERY = "TNFAIP3 is a tumor suppressor in glioblastoma."


@pytest.fixture
async def server(service: RerankerService) -> AsyncIterator[GrpcServer]:
    async with grpc_test_server(
        rerank_pb2_grpc.add_RerankerServiceServicer_to_server,
        RerankerApi(service),
        "forge.rerank.v1.RerankerService",
        token=TOKEN,
        service="reranker",
    ) as started:
        yield started


@pytest.fixture
async def stub(server: GrpcServer) -> AsyncIterator[rerank_pb2_grpc.RerankerServiceStub]:
    async with make_channel(f"127.0.0.1:{server.port}", token=TOKEN) as channel:
        yield rerank_pb2_grpc.RerankerServiceStub(channel)


def request(passages: list[PassageIn], **kwargs: object) -> rerank_pb2.RerankRequest:
    return rerank_pb2.RerankRequest(
        query=QUERY,
        passages=[rerank_pb2.Passage(id=p.id, text=p.text) for p in passages],
        **kwargs,  # type: ignore[arg-type]
    )


async def test_health_and_auth(server: GrpcServer) -> None:
    assert await check_health(f"127.0.0.1:{server.port}")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await rerank_pb2_grpc.RerankerServiceStub(channel).Rerank(rerank_pb2.RerankRequest(query="q"))
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_rerank_returns_the_relevant_passage_first(
    stub: rerank_pb2_grpc.RerankerServiceStub, passages: list[PassageIn]
) -> None:
    reply = await stub.Rerank(request(passages, top_n=2))
    assert reply.model == "bm25-phrase"
    assert [(r.id, r.index) for r in reply.results] == [("p2", 2), ("p0", 0)]
    assert reply.results[0].score > reply.results[1].score


async def test_retrieval_scores_are_blended_and_the_model_score_comes_back(
    stub: rerank_pb2_grpc.RerankerServiceStub, passages: list[PassageIn]
) -> None:
    model = {r.id: r.score for r in (await stub.Rerank(request(passages))).results}
    retrieval = [0.9, 0.2, 0.1, 0.0]  # the first stage is sure of p0
    reply = await stub.Rerank(
        rerank_pb2.RerankRequest(
            query=QUERY,
            passages=[
                rerank_pb2.Passage(id=p.id, text=p.text, retrieval_score=r)
                for p, r in zip(passages, retrieval, strict=True)
            ],
        )
    )
    assert {r.id: r.model_score for r in reply.results} == pytest.approx(model)
    expected = blend([model[p.id] for p in passages], retrieval, RerankerSettings().retrieval_weight)
    assert [r.id for r in reply.results] == [
        passages[i].id for i in sorted(range(len(passages)), key=lambda i: -expected[i])
    ]
    assert [r.score for r in reply.results] == pytest.approx(sorted(expected, reverse=True))
    assert reply.results[0].id == "p0"  # second for the model alone, first blended


@pytest.mark.parametrize(("kwargs", "field"), [({"top_n": 9}, "top_n"), ({"model": "nope"}, "model")])
async def test_invalid_request_names_the_field(
    stub: rerank_pb2_grpc.RerankerServiceStub,
    passages: list[PassageIn],
    kwargs: dict[str, object],
    field: str,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Rerank(request(passages, **kwargs))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (FIELD_METADATA_KEY, field) in tuple(caught.value.trailing_metadata() or ())


async def test_too_many_passages_is_invalid(stub: rerank_pb2_grpc.RerankerServiceStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Rerank(request([PassageIn(str(i), f"passage {i}") for i in range(9)]))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("passages:")


async def test_scores_are_shared_through_redis(
    redis_url: str, scorer: CountingScorer, settings: RerankerSettings, passages: list[PassageIn]
) -> None:
    namespace = f"reranker-test-{uuid.uuid4().hex}"
    first_cache, second_cache = make_cache(redis_url, namespace), make_cache(redis_url, namespace)
    try:
        first = (await RerankerService(scorer, first_cache, settings).rerank(QUERY, passages, 0, "")).passages
        # A second replica with its own connection finds every score already computed.
        second = (
            await RerankerService(scorer, second_cache, settings).rerank(QUERY, passages, 0, "")
        ).passages
        assert len(scorer.calls) == 1
        assert [(r.id, r.score) for r in second] == [(r.id, r.score) for r in first]
    finally:
        await first_cache.close()
        await second_cache.close()
