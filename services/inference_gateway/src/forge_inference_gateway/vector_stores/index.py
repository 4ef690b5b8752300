"""The retriever as the vector-store API writes to and searches it: over gRPC with the gateway's
service token, acting for the caller's tenant (``forge-tenant`` metadata = the tenant's name), so
the retriever keeps every tenant's collections apart whatever a request names."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import grpc
from forge.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc

from forge_inference_gateway.rag.clients import TENANT_METADATA_KEY, Candidate, grpc_error
from forge_kit.grpckit import make_channel


@dataclass(frozen=True)
class IndexDocument:
    """A document as the retriever stores it: ``metadata`` values are strings."""

    id: str
    text: str
    title: str = ""
    metadata: Mapping[str, str] = field(default_factory=dict)


class DocumentIndex(Protocol):
    """The retriever as :class:`~forge_inference_gateway.vector_stores.service.VectorStores` calls it: one
    call per upload, delete or search, each all-or-nothing on the retriever's side."""

    async def upsert(
        self, tenant: str, collection: str, documents: Sequence[IndexDocument], timeout_s: float
    ) -> int:
        """Add or replace documents by id; the number written (unchanged ones are not)."""
        ...

    async def delete(self, tenant: str, collection: str, ids: Sequence[str], timeout_s: float) -> int:
        """Remove documents by id; the number that were held."""
        ...

    async def search(
        self, tenant: str, collection: str, query: str, top_k: int, where: Mapping[str, str], timeout_s: float
    ) -> list[Candidate]:
        """The best ``top_k`` chunks (hybrid), best first; an empty or unknown collection has none."""
        ...


class GrpcDocumentIndex:
    """:class:`DocumentIndex` over ``forge.retrieval.v1.RetrieverService``."""

    def __init__(self, target: str, token: str | None) -> None:
        self._channel = make_channel(target, token=token, max_attempts=2, initial_backoff_s=0.05)
        self._stub = retrieval_pb2_grpc.RetrieverServiceStub(self._channel)

    async def upsert(
        self, tenant: str, collection: str, documents: Sequence[IndexDocument], timeout_s: float
    ) -> int:
        request = retrieval_pb2.UpsertDocumentsRequest(
            collection=collection,
            documents=[
                retrieval_pb2.Document(id=d.id, text=d.text, title=d.title, metadata=dict(d.metadata))
                for d in documents
            ],
        )
        try:
            reply = await self._stub.UpsertDocuments(
                request, timeout=timeout_s, metadata=((TENANT_METADATA_KEY, tenant),)
            )
        except grpc.aio.AioRpcError as exc:
            raise grpc_error("retriever", exc) from None
        return int(reply.upserted_count)

    async def delete(self, tenant: str, collection: str, ids: Sequence[str], timeout_s: float) -> int:
        request = retrieval_pb2.DeleteDocumentsRequest(collection=collection, ids=list(ids))
        try:
            reply = await self._stub.DeleteDocuments(
                request, timeout=timeout_s, metadata=((TENANT_METADATA_KEY, tenant),)
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.INVALID_ARGUMENT and "unknown collection" in (
                exc.details() or ""
            ):
                return 0
            raise grpc_error("retriever", exc) from None
        return int(reply.deleted_count)

    async def search(
        self, tenant: str, collection: str, query: str, top_k: int, where: Mapping[str, str], timeout_s: float
    ) -> list[Candidate]:
        request = retrieval_pb2.SearchRequest(
            collection=collection,
            query=query,
            top_k=top_k,
            mode=retrieval_pb2.SEARCH_MODE_HYBRID,
            filter=dict(where),
        )
        try:
            reply = await self._stub.Search(
                request, timeout=timeout_s, metadata=((TENANT_METADATA_KEY, tenant),)
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.INVALID_ARGUMENT and "unknown collection" in (
                exc.details() or ""
            ):
                return []
            raise grpc_error("retriever", exc) from None
        return [Candidate(c.document_id, c.chunk_id, c.text, c.score, dict(c.metadata)) for c in reply.chunks]

    async def close(self) -> None:
        await self._channel.close(None)
