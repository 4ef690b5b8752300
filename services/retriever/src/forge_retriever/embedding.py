"""Text → vectors with the retriever's own embedder, for callers outside retrieval (the gateway's
``/v1/embeddings``): the ``Embed`` RPC's domain side.

Input is bounded (at most ``MAX_TEXTS`` texts of at most ``MAX_CHARS`` characters, none empty);
each text is truncated to what the embedder takes, and the tokens it read are counted for usage.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from forge_kit import errors
from forge_retriever.embed import Embedder

#: Most texts one call may embed.
MAX_TEXTS = 256
#: Most characters of one text (the embedder reads its first few hundred tokens anyway).
MAX_CHARS = 32_768


@dataclass(frozen=True)
class Embedded:
    vectors: list[list[float]]
    token_counts: list[int]
    model: str
    dimension: int


def serves(embedder: Embedder, model: str) -> bool:
    """Whether ``model`` names ``embedder``: empty, its full name or its last path segment."""
    return model in ("", embedder.name, embedder.name.rsplit("/", 1)[-1])


async def embed_texts(embedder: Embedder | None, texts: Sequence[str], model: str = "") -> Embedded:
    """The vectors and token counts of ``texts``, in order (the work runs on a worker thread)."""
    if embedder is None:
        raise errors.ConflictError("this retriever has no embedder: its index is BM25 only")
    if not serves(embedder, model):
        raise errors.NotFoundError(f"the embedding model `{model}` is not served (served: {embedder.name})")
    if not 1 <= len(texts) <= MAX_TEXTS:
        raise errors.ValidationError("texts", f"must hold 1 to {MAX_TEXTS} texts, got {len(texts)}")
    for i, text in enumerate(texts):
        if not text.strip():
            raise errors.ValidationError(f"texts.{i}", "must not be empty")
        if len(text) > MAX_CHARS:
            raise errors.ValidationError(f"texts.{i}", f"is {len(text)} characters; at most {MAX_CHARS}")
    vectors = await asyncio.to_thread(embedder.embed_documents, list(texts))
    counts = await asyncio.to_thread(embedder.count_tokens, list(texts))
    return Embedded(vectors, counts, embedder.name, embedder.dimension)
