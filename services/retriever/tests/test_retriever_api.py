"""The retriever's gRPC surface on a real server with a real Qdrant Edge index."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc
import pytest
from forge.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc

from forge_kit.grpckit import FIELD_METADATA_KEY, GrpcServer, check_health, make_channel
from forge_kit.testing.grpcserver import grpc_test_server
from forge_retriever.api import SEARCH_MODE_METADATA_KEY, RetrieverApi
from forge_retriever.service import RetrieverService

if TYPE_CHECKING:
    from conftest import SciFactSample

pytestmark = [pytest.mark.asyncio, pytest.mark.integration]
TOKEN = "test-token"
Stub = retrieval_pb2_grpc.RetrieverServiceStub


@pytest.fixture
async def server(service: RetrieverService) -> AsyncIterator[GrpcServer]:
    async with grpc_test_server(
        retrieval_pb2_grpc.add_RetrieverServiceServicer_to_server,
        RetrieverApi(service),
        "forge.retrieval.v1.RetrieverService",
        token=TOKEN,
        service="retriever",
    ) as started:
        yield started


@pytest.fixture
async def stub(server: GrpcServer) -> AsyncIterator[Stub]:
    async with make_channel(f"127.0.0.1:{server.port}", token=TOKEN) as channel:
        yield retrieval_pb2_grpc.RetrieverServiceStub(channel)


def to_proto(sample: SciFactSample) -> list[retrieval_pb2.Document]:
    return [
        retrieval_pb2.Document(id=d.id, title=d.title, text=d.text, metadata={"source": "scifact"})
        for d in sample.documents
    ]


async def test_health_and_auth(server: GrpcServer) -> None:
    assert await check_health(f"127.0.0.1:{server.port}")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await Stub(channel).ListCollections(retrieval_pb2.ListCollectionsRequest())
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_upsert_search_delete_list(stub: Stub, scifact: SciFactSample) -> None:
    upserted = await stub.UpsertDocuments(
        retrieval_pb2.UpsertDocumentsRequest(collection="scifact", documents=to_proto(scifact))
    )
    assert upserted.upserted_count == len(scifact.documents) and upserted.chunk_count >= len(
        scifact.documents
    )

    query, relevant = next(iter(scifact.relevant.values()))
    call = stub.Search(retrieval_pb2.SearchRequest(collection="scifact", query=query))  # HYBRID, server top_k
    found = await call
    assert len(found.chunks) == 10 and relevant & {c.document_id for c in found.chunks}
    assert (SEARCH_MODE_METADATA_KEY, "sparse") in tuple(await call.trailing_metadata() or ())
    best = found.chunks[0]
    assert best.document_id in relevant and best.chunk_id.startswith(f"{best.document_id}#")
    assert best.text and best.sparse_score == best.score > 0 and best.dense_score == 0
    assert best.metadata["source"] == "scifact" and best.metadata["title"]

    listed = await stub.ListCollections(retrieval_pb2.ListCollectionsRequest())
    assert [(c.name, c.document_count) for c in listed.collections] == [("scifact", len(scifact.documents))]
    assert listed.collections[0].chunk_count == upserted.chunk_count

    deleted = await stub.DeleteDocuments(
        retrieval_pb2.DeleteDocumentsRequest(collection="scifact", ids=sorted(relevant))
    )
    assert deleted.deleted_count == len(relevant)
    after = await stub.Search(
        retrieval_pb2.SearchRequest(
            collection="scifact", query=query, top_k=1000, mode=retrieval_pb2.SEARCH_MODE_SPARSE
        )
    )
    assert after.chunks and not relevant & {c.document_id for c in after.chunks}


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (retrieval_pb2.SearchRequest(collection="", query="q"), "collection"),
        (retrieval_pb2.SearchRequest(collection="c", query=""), "query"),
        (retrieval_pb2.SearchRequest(collection="c", query="q", top_k=1001), "top_k"),
        (retrieval_pb2.SearchRequest(collection="nope", query="q"), "collection"),
    ],
)
async def test_invalid_search_names_the_field(
    stub: Stub, request_: retrieval_pb2.SearchRequest, field: str
) -> None:
    await stub.UpsertDocuments(
        retrieval_pb2.UpsertDocumentsRequest(
            collection="c", documents=[retrieval_pb2.Document(id="a", text="x")]
        )
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Search(request_)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(f"{field}:")
    assert (FIELD_METADATA_KEY, field) in tuple(caught.value.trailing_metadata() or ())


async def test_invalid_upsert_names_the_field(stub: Stub) -> None:
    docs = [retrieval_pb2.Document(id="a", text="fine"), retrieval_pb2.Document(id="b", text="")]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.UpsertDocuments(retrieval_pb2.UpsertDocumentsRequest(collection="c", documents=docs))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (FIELD_METADATA_KEY, "documents[1].text") in tuple(caught.value.trailing_metadata() or ())
    assert (await stub.ListCollections(retrieval_pb2.ListCollectionsRequest())).collections == []


async def test_dense_search_is_a_failed_precondition(stub: Stub) -> None:
    await stub.UpsertDocuments(
        retrieval_pb2.UpsertDocumentsRequest(
            collection="c", documents=[retrieval_pb2.Document(id="a", text="x")]
        )
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Search(
            retrieval_pb2.SearchRequest(collection="c", query="x", mode=retrieval_pb2.SEARCH_MODE_DENSE)
        )
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "dense index not enabled" in (caught.value.details() or "")
