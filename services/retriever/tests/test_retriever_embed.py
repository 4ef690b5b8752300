"""The ``Embed`` RPC on a real server with the real bundled MiniLM: the embedder's own vectors
and token counts, bounded input, the model named or refused."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from forge.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc

from forge_kit.grpckit import FIELD_METADATA_KEY
from forge_kit.testing.grpcserver import grpc_test_server
from forge_retriever.api import RetrieverApi
from forge_retriever.embed import SentenceTransformerEmbedder
from forge_retriever.embedding import MAX_TEXTS
from forge_retriever.service import RetrieverService

pytestmark = [pytest.mark.asyncio, pytest.mark.integration]
TOKEN = "embed-token"
METADATA = (("authorization", f"Bearer {TOKEN}"), ("forge-tenant", "acme"))


async def _stub(service: RetrieverService) -> AsyncIterator[retrieval_pb2_grpc.RetrieverServiceStub]:
    async with (
        grpc_test_server(
            retrieval_pb2_grpc.add_RetrieverServiceServicer_to_server,
            RetrieverApi(service),
            "forge.retrieval.v1.RetrieverService",
            token=TOKEN,
            service="retriever",
            default_deadline_s=30,
        ) as server,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        yield retrieval_pb2_grpc.RetrieverServiceStub(channel)


@pytest.fixture
async def stub(dense_service: RetrieverService) -> AsyncIterator[retrieval_pb2_grpc.RetrieverServiceStub]:
    async for s in _stub(dense_service):
        yield s


async def test_embed_returns_the_embedders_vectors_and_token_counts(
    stub: retrieval_pb2_grpc.RetrieverServiceStub, minilm: SentenceTransformerEmbedder
) -> None:
    texts = ["Aspirin lowers the risk of heart attack.", "word " * 1000]
    reply = await stub.Embed(retrieval_pb2.EmbedRequest(texts=texts), metadata=METADATA)
    assert reply.model == minilm.name and reply.dimension == minilm.dimension == 384
    expected = minilm.embed_documents(texts)
    for got, want in zip(reply.embeddings, expected, strict=True):
        assert got.vector == pytest.approx(want, abs=1e-5)
    counts = [e.token_count for e in reply.embeddings]
    assert counts[0] == len(minilm._model.tokenizer(texts[0])["input_ids"]) and 5 < counts[0] < 20
    assert counts[1] == 256  # truncated at the embedder's max_seq_length
    short_name = minilm.name.rsplit("/", 1)[-1]
    named = await stub.Embed(retrieval_pb2.EmbedRequest(texts=texts[:1], model=short_name), metadata=METADATA)
    assert named.embeddings[0].vector == pytest.approx(reply.embeddings[0].vector, abs=1e-5)


@pytest.mark.parametrize(
    ("request_", "code", "field"),
    [
        (retrieval_pb2.EmbedRequest(texts=[]), grpc.StatusCode.INVALID_ARGUMENT, "texts"),
        (
            retrieval_pb2.EmbedRequest(texts=["a"] * (MAX_TEXTS + 1)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "texts",
        ),
        (retrieval_pb2.EmbedRequest(texts=["a", "  "]), grpc.StatusCode.INVALID_ARGUMENT, "texts.1"),
        (
            retrieval_pb2.EmbedRequest(texts=["a"], model="text-embedding-3-small"),
            grpc.StatusCode.NOT_FOUND,
            None,
        ),
    ],
)
async def test_bad_embed_requests_are_refused(
    stub: retrieval_pb2_grpc.RetrieverServiceStub,
    request_: retrieval_pb2.EmbedRequest,
    code: grpc.StatusCode,
    field: str | None,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Embed(request_, metadata=METADATA)
    assert caught.value.code() == code
    if field is not None:
        assert dict(caught.value.trailing_metadata() or ())[FIELD_METADATA_KEY] == field


async def test_a_bm25_only_retriever_says_it_has_no_embedder(service: RetrieverService) -> None:
    async for stub in _stub(service):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Embed(retrieval_pb2.EmbedRequest(texts=["a"]), metadata=METADATA)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
