"""``POST /v1/embeddings``: the retriever's embedder behind the OpenAI embeddings API.

The gateway does not embed: it calls the retriever's ``Embed`` RPC (``forge.retrieval.v1``) with
its service token, acting for the caller's tenant (``forge-tenant``), after the route has
authenticated the key and admitted it against the tenant's rate limit. ``input`` is a text or a
list of texts; token-id input is refused (``param`` ``input``: the embedder has its own
tokenizer). ``encoding_format`` ``float`` or ``base64`` (little-endian float32, what the SDK asks
for by default); ``dimensions`` only as the model's own. Usage counts the tokens the embedder read.
"""

from __future__ import annotations

import base64
import math
import struct
import time
from collections.abc import Callable

import grpc
from forge.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc

from forge_inference_gateway.rag.clients import TENANT_METADATA_KEY, grpc_error
from forge_inference_gateway.tenants.registry import Tenant
from forge_kit import errors
from forge_kit.grpckit import make_channel
from forge_kit.openai_protocol import (
    MAX_EMBEDDING_CHARS,
    MAX_EMBEDDING_INPUTS,
    EmbeddingBody,
    parse,
    refuse_unsupported,
)

#: Seconds before a retriever that could not embed is asked for the model card again.
CARD_RETRY_S = 60.0


class GrpcEmbedder:
    """The retriever's ``Embed`` with the gateway's service token."""

    def __init__(self, target: str, token: str | None, timeout_s: float = 30.0) -> None:
        self._channel = make_channel(target, token=token, max_attempts=2, initial_backoff_s=0.05)
        self._stub = retrieval_pb2_grpc.RetrieverServiceStub(self._channel)
        self._timeout_s = timeout_s
        self._card: dict[str, object] | None = None
        self._card_checked = -math.inf

    async def card(
        self, tenant: str, clock: Callable[[], float] = time.monotonic
    ) -> dict[str, object] | None:
        """The embedding model's ``/v1/models`` card (``type`` ``embedding``, its dimension), learnt
        from one short ``Embed`` and kept; None while the retriever cannot embed (asked again a
        minute later)."""
        if self._card is not None or clock() - self._card_checked < CARD_RETRY_S:
            return self._card
        self._card_checked = clock()
        request = retrieval_pb2.EmbedRequest(texts=["model card"])
        try:
            reply = await self._stub.Embed(request, timeout=2.0, metadata=((TENANT_METADATA_KEY, tenant),))
        except grpc.aio.AioRpcError:
            return None
        self._card = {
            "id": reply.model,
            "object": "model",
            "created": 0,
            "owned_by": "forge",
            "type": "embedding",
            "dimension": int(reply.dimension),
        }
        return self._card

    async def embed(self, tenant: str, texts: list[str], model: str) -> retrieval_pb2.EmbedResponse:
        request = retrieval_pb2.EmbedRequest(texts=texts, model=model)
        try:
            return await self._stub.Embed(
                request, timeout=self._timeout_s, metadata=((TENANT_METADATA_KEY, tenant),)
            )
        except grpc.aio.AioRpcError as exc:
            error = grpc_error("retriever", exc)
            if isinstance(error, errors.ValidationError) and error.field.startswith("texts"):
                field = "input" + error.field.removeprefix("texts")
                raise errors.ValidationError(field, error.message.partition(": ")[2]) from None
            raise error from None

    async def close(self) -> None:
        await self._channel.close(None)


def _texts(raw: object) -> list[str]:
    if isinstance(raw, str):
        texts = [raw]
    elif isinstance(raw, list) and all(isinstance(t, str) for t in raw):
        texts = list(raw)
    else:
        raise errors.ValidationError("input", "token ids are not accepted: send text, or a list of texts")
    if not 1 <= len(texts) <= MAX_EMBEDDING_INPUTS:
        raise errors.ValidationError(
            "input", f"must hold 1 to {MAX_EMBEDDING_INPUTS} texts, got {len(texts)}"
        )
    for i, text in enumerate(texts):
        if not text.strip():
            raise errors.ValidationError(f"input.{i}", "must not be empty")
        if len(text) > MAX_EMBEDDING_CHARS:
            raise errors.ValidationError(
                f"input.{i}", f"is {len(text)} characters; at most {MAX_EMBEDDING_CHARS}"
            )
    return texts


def _encode(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector


async def create_embeddings(embedder: GrpcEmbedder, tenant: Tenant, raw: object) -> dict[str, object]:
    """The OpenAI embeddings answer for the body ``raw``, embedded for ``tenant``."""
    body = parse(EmbeddingBody, raw)
    refuse_unsupported(dict(body.model_extra or {}))
    texts = _texts(body.input)
    reply = await embedder.embed(tenant.name, texts, body.model)
    if body.dimensions is not None and body.dimensions != reply.dimension:
        raise errors.UnsupportedParameterError(
            "dimensions",
            f"vectors of {reply.model} have {reply.dimension} dimensions; no other size is served",
        )
    tokens = sum(e.token_count for e in reply.embeddings)
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": _encode(list(e.vector), body.encoding_format)}
            for i, e in enumerate(reply.embeddings)
        ],
        "model": reply.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
