"""The retriever and the reranker as RAG calls them (steps 3 and 4), over gRPC with the gateway's
service token, and the domain errors their failures stand for."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import structlog
from forge.rerank.v1 import rerank_pb2, rerank_pb2_grpc
from forge.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc

from forge_inference_gateway.rag.query import RagQuery
from forge_inference_gateway.replicas.upstream import UpstreamError, UpstreamUnavailableError
from forge_kit import errors
from forge_kit.grpckit import FIELD_METADATA_KEY, make_channel

log = structlog.get_logger(__name__)

#: gRPC request metadata naming the tenant the gateway acts for (the retriever's ``tenancy.py``).
TENANT_METADATA_KEY = "forge-tenant"


@dataclass(frozen=True)
class Candidate:
    """A retrieved chunk (step 3), in retriever order."""

    document_id: str
    chunk_id: str
    text: str
    score: float
    metadata: dict[str, str]


class Retriever(Protocol):
    """The retriever as the RAG service calls it in step 3, once per query."""

    async def search(self, tenant: str, query: RagQuery, timeout_s: float) -> tuple[list[Candidate], str]:
        """The top ``query.top_k`` chunks best first, and how they were scored (``hybrid``, ``sparse``)."""
        ...


@dataclass(frozen=True)
class RerankAnswer:
    """What the reranker returned: ``order`` is ``(index into candidates, score)`` best first, at
    most ``top_n``; with ``partial`` only ``scored`` candidates were scored before the deadline
    and the rest follow in retriever order."""

    order: list[tuple[int, float]]
    model: str
    partial: bool = False
    scored: int = 0


class Reranker(Protocol):
    """The reranker as the RAG service calls it in step 4, once per query with candidates."""

    async def rerank(
        self, query: str, candidates: Sequence[Candidate], top_n: int, timeout_s: float
    ) -> RerankAnswer:
        """The candidates reranked within ``timeout_s`` (the deadline the reranker plans for)."""
        ...


def _metadata(metadata: Iterable[Any] | None, key: str) -> str | None:
    """The first value of ``key`` in gRPC metadata (``grpc.aio.Metadata`` or a tuple of pairs)."""
    for item in metadata or ():
        if item[0] == key:
            value = item[1]
            return value.decode() if isinstance(value, bytes) else str(value)
    return None


def grpc_error(service: str, exc: grpc.aio.AioRpcError) -> Exception:
    """The domain error a failed retriever/reranker call stands for."""
    code, details = exc.code(), exc.details() or ""
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        field_name = _metadata(exc.trailing_metadata(), FIELD_METADATA_KEY) or "request"
        prefix = f"{field_name}: "
        return errors.ValidationError(field_name, details.removeprefix(prefix))
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return TimeoutError(f"{service} did not answer within the deadline")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
        return UpstreamUnavailableError(f"{service} unavailable: {details}")
    if code is grpc.StatusCode.NOT_FOUND:
        return errors.NotFoundError(details)
    log.warning("rag.downstream_failed", service=service, code=code.name, details=details)
    return UpstreamError(f"{service} failed ({code.name})")


class GrpcRetriever:
    """``forge.retrieval.v1.RetrieverService`` with the gateway's service token."""

    def __init__(self, target: str, token: str | None) -> None:
        self._channel = make_channel(target, token=token, max_attempts=2, initial_backoff_s=0.05)
        self._stub = retrieval_pb2_grpc.RetrieverServiceStub(self._channel)

    async def search(self, tenant: str, query: RagQuery, timeout_s: float) -> tuple[list[Candidate], str]:
        request = retrieval_pb2.SearchRequest(
            collection=query.collection,
            query=query.query,
            top_k=query.top_k,
            mode=retrieval_pb2.SEARCH_MODE_HYBRID,
            filter=query.filter,
        )
        call = self._stub.Search(request, timeout=timeout_s, metadata=((TENANT_METADATA_KEY, tenant),))
        try:
            reply = await call
            trailing = await call.trailing_metadata()
        except grpc.aio.AioRpcError as exc:
            raise grpc_error("retriever", exc) from None
        mode = _metadata(trailing, "forge-search-mode") or "hybrid"
        return [
            Candidate(c.document_id, c.chunk_id, c.text, c.score, dict(c.metadata)) for c in reply.chunks
        ], mode

    async def close(self) -> None:
        await self._channel.close(None)


class GrpcReranker:
    """``forge.rerank.v1.RerankerService`` with the gateway's service token."""

    def __init__(self, target: str, token: str | None) -> None:
        # One quick retry at most: a reranker that is down is skipped, not waited for.
        self._channel = make_channel(target, token=token, max_attempts=2, initial_backoff_s=0.01)
        self._stub = rerank_pb2_grpc.RerankerServiceStub(self._channel)

    async def rerank(
        self, query: str, candidates: Sequence[Candidate], top_n: int, timeout_s: float
    ) -> RerankAnswer:
        request = rerank_pb2.RerankRequest(
            query=query,
            passages=[
                rerank_pb2.Passage(id=str(i), text=c.text, retrieval_score=c.score)
                for i, c in enumerate(candidates)
            ],
            top_n=top_n,
        )
        try:
            reply = await self._stub.Rerank(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise grpc_error("reranker", exc) from None
        return RerankAnswer(
            [(int(r.index), float(r.score)) for r in reply.results],
            reply.model,
            partial=reply.partial,
            scored=int(reply.scored),
        )

    async def close(self) -> None:
        await self._channel.close(None)
