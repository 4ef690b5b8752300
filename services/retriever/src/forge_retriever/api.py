"""gRPC servicer of ``forge.retrieval.v1.RetrieverService`` and the document-change consumer's
handler: translation only, between the protos and the service's dataclasses.

The tenant of every call comes from the caller (``tenancy.caller_tenant``), never from the request.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc
from forge.events.v1 import events_pb2
from forge.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from google.protobuf.message import Message
from sqlalchemy.ext.asyncio import AsyncSession

from forge_kit import errors
from forge_kit.grpckit import current_principal
from forge_retriever.documents import DocumentIn, SearchMode
from forge_retriever.embedding import embed_texts
from forge_retriever.messages import document_change
from forge_retriever.service import RetrieverService
from forge_retriever.tenancy import caller_tenant

#: Trailing metadata key telling how a Search was scored (``sparse`` for a HYBRID request served by
#: BM25 alone); SearchResponse has no field for it.
SEARCH_MODE_METADATA_KEY = "forge-search-mode"

#: Trailing metadata key, ``1`` when the query's embedding saw only its first
#: ``MAX_DENSE_QUERY_CHARS`` characters (BM25 always scores the whole query).
DENSE_TRUNCATED_METADATA_KEY = "forge-dense-query-truncated"

_MODES = {
    retrieval_pb2.SEARCH_MODE_UNSPECIFIED: SearchMode.HYBRID,
    retrieval_pb2.SEARCH_MODE_HYBRID: SearchMode.HYBRID,
    retrieval_pb2.SEARCH_MODE_DENSE: SearchMode.DENSE,
    retrieval_pb2.SEARCH_MODE_SPARSE: SearchMode.SPARSE,
}


class RetrieverApi(retrieval_pb2_grpc.RetrieverServiceServicer):
    def __init__(self, service: RetrieverService) -> None:
        self._service = service

    async def UpsertDocuments(
        self, request: retrieval_pb2.UpsertDocumentsRequest, context: grpc.aio.ServicerContext
    ) -> retrieval_pb2.UpsertDocumentsResponse:
        docs = [
            DocumentIn(id=d.id, text=d.text, title=d.title, metadata=dict(d.metadata))
            for d in request.documents
        ]
        result = await self._service.upsert_documents(request.collection, docs, tenant=_tenant(context))
        return retrieval_pb2.UpsertDocumentsResponse(
            upserted_count=result.upserted, chunk_count=result.chunks
        )

    async def DeleteDocuments(
        self, request: retrieval_pb2.DeleteDocumentsRequest, context: grpc.aio.ServicerContext
    ) -> retrieval_pb2.DeleteDocumentsResponse:
        deleted = await self._service.delete_documents(
            request.collection, list(request.ids), tenant=_tenant(context)
        )
        return retrieval_pb2.DeleteDocumentsResponse(deleted_count=deleted)

    async def Search(
        self, request: retrieval_pb2.SearchRequest, context: grpc.aio.ServicerContext
    ) -> retrieval_pb2.SearchResponse:
        mode = _MODES.get(request.mode)
        if mode is None:
            raise errors.ValidationError("mode", f"unknown search mode {request.mode}")
        result = await self._service.search(
            request.collection,
            request.query,
            request.top_k,
            mode,
            dict(request.filter),
            tenant=_tenant(context),
        )
        context.set_trailing_metadata(
            (
                (SEARCH_MODE_METADATA_KEY, result.mode.value),
                (DENSE_TRUNCATED_METADATA_KEY, "1" if result.dense_truncated else "0"),
            )
        )
        return retrieval_pb2.SearchResponse(
            chunks=[
                retrieval_pb2.ScoredChunk(
                    document_id=h.document_id,
                    chunk_id=h.chunk_id,
                    text=h.text,
                    score=h.score,
                    dense_score=h.dense_score,
                    sparse_score=h.sparse_score,
                    metadata=h.metadata,
                )
                for h in result.hits
            ]
        )

    async def ListCollections(
        self, request: retrieval_pb2.ListCollectionsRequest, context: grpc.aio.ServicerContext
    ) -> retrieval_pb2.ListCollectionsResponse:
        return retrieval_pb2.ListCollectionsResponse(
            collections=[
                retrieval_pb2.Collection(
                    name=c.name,
                    document_count=c.document_count,
                    chunk_count=c.chunk_count,
                    embedding_model=self._service.embedding_model,
                    dimension=self._service.embedding_dimension,
                )
                for c in await self._service.list_collections(tenant=_tenant(context))
            ]
        )

    async def Embed(
        self, request: retrieval_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> retrieval_pb2.EmbedResponse:
        _tenant(context)  # the caller must act for a tenant, as on every other call
        result = await embed_texts(self._service.embedder, list(request.texts), request.model)
        return retrieval_pb2.EmbedResponse(
            embeddings=[
                retrieval_pb2.Embedding(vector=vector, token_count=count)
                for vector, count in zip(result.vectors, result.token_counts, strict=True)
            ],
            model=result.model,
            dimension=result.dimension,
        )


def _tenant(context: grpc.aio.ServicerContext) -> str:
    return caller_tenant(current_principal(), context.invocation_metadata() or ())


def document_change_handler(service: RetrieverService) -> Callable[[Message, AsyncSession], Awaitable[None]]:
    """The document-change consumer's handler (``forge_kit.consumer.EventConsumer``): the event,
    read into a ``DocumentChange``, applied inside the consumer's transaction."""

    async def handle(event: Message, session: AsyncSession) -> None:
        if not isinstance(event, events_pb2.DocumentChanged):
            raise errors.ValidationError("event", f"{event.DESCRIPTOR.full_name} is not a DocumentChanged")
        await service.apply_document_change(document_change(event), session)

    return handle
