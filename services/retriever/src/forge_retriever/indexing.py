"""The index side of the retriever: chunk and encode documents, query the index, rebuild it.

The database is the source of truth and the index is derived from it; :class:`IndexedChunks`
turns chunks into index points (BM25 terms, and embeddings when dense search is on), answers the
index queries a search needs, and rebuilds a collection's points from the database's chunks.
Encoding and querying block (embedding is CPU-bound): callers run them in a thread.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import structlog

from forge_kit.db import Database
from forge_retriever.chunking import HfTokenizer, TokenChunker
from forge_retriever.config import RetrieverSettings
from forge_retriever.documents import SearchMode
from forge_retriever.embed import Embedder, bundled_minilm_path
from forge_retriever.index import Fusion, HybridParams, IndexHit, IndexPoint, VectorIndex
from forge_retriever.store import ChunkRow, DocumentRow, chunks_with_documents
from forge_retriever.text import Bm25Encoder

log = structlog.get_logger(__name__)

_REBUILD_BATCH = 500


@functools.cache
def _tokenizer(model_dir: str) -> HfTokenizer:
    return HfTokenizer(model_dir)


def chunker_for(settings: RetrieverSettings) -> TokenChunker:
    """The chunker ``settings`` describe: windows of the embedding model's tokenizer."""
    tokenizer = _tokenizer(settings.embedding_model_path or str(bundled_minilm_path()))
    return TokenChunker(
        tokenizer, settings.chunk_tokens, settings.chunk_overlap_tokens, fingerprint=tokenizer.fingerprint
    )


def sparse_encoder(settings: RetrieverSettings) -> Bm25Encoder:
    """The BM25 encoder ``settings`` describe (its ``version`` goes into the index's schema)."""
    return Bm25Encoder(settings.bm25_k1, settings.bm25_b, settings.bm25_avg_len, settings.bm25_language)


@dataclass(frozen=True)
class PendingPoint:
    """A chunk to index: what :meth:`IndexedChunks.points` needs to encode it (sparse) and embed
    it (dense)."""

    point_id: str
    tenant: str
    document_id: str
    chunk_index: int
    title: str
    text: str
    metadata: Mapping[str, str]


class IndexedChunks:
    """Encodes chunks into ``index`` and queries it; with an ``embedder`` dense vectors too."""

    def __init__(self, index: VectorIndex, settings: RetrieverSettings, embedder: Embedder | None) -> None:
        if index.dense_enabled != (embedder is not None):
            raise ValueError("an embedder is needed exactly when the index holds dense vectors")
        self.index = index
        self.embedder = embedder
        self._settings = settings
        self._encoder = sparse_encoder(settings)
        self._hybrid = HybridParams(
            candidates=settings.hybrid_candidates, fusion=Fusion(settings.hybrid_fusion), rrf_k=settings.rrf_k
        )

    def points(self, pending: Sequence[PendingPoint]) -> list[IndexPoint]:
        """Encode chunks for the index (blocking: embedding is CPU-bound, run it in a thread)."""
        # The title is indexed with every chunk: it is the densest statement of what the chunk is about.
        texts = [f"{p.title}\n{p.text}" if p.title else p.text for p in pending]
        dense: Sequence[Sequence[float] | None] = (
            self.embedder.embed_documents(texts) if self.embedder is not None else [None] * len(texts)
        )
        return [
            IndexPoint(
                point_id=p.point_id,
                document_id=p.document_id,
                chunk_index=p.chunk_index,
                sparse=self._encoder.encode_document(text),
                metadata=p.metadata,
                dense=vector,
                tenant=p.tenant,
            )
            for p, text, vector in zip(pending, texts, dense, strict=True)
        ]

    def query(
        self,
        collection: str,
        tenant: str,
        query: str,
        top_k: int,
        mode: SearchMode,
        metadata_filter: dict[str, str],
    ) -> list[IndexHit]:
        """Encode ``query`` as ``mode`` needs and search the index (blocking: runs in a thread)."""
        if mode is SearchMode.SPARSE or self.embedder is None:
            return self.index.search_sparse(
                collection, self._encoder.encode_query(query), top_k, metadata_filter, tenant=tenant
            )
        vector = self.embedder.embed_query(query[: self._settings.max_dense_query_chars])
        if mode is SearchMode.DENSE:
            return self.index.search_dense(collection, vector, top_k, metadata_filter, tenant=tenant)
        return self.index.search_hybrid(
            collection,
            self._encoder.encode_query(query),
            vector,
            top_k,
            metadata_filter,
            self._hybrid,
            tenant=tenant,
        )

    async def reconcile(self, db: Database, chunk_counts: Mapping[str, int]) -> list[str]:
        """Drop index collections the database does not have (``chunk_counts``: the database's
        chunks per collection) and rebuild every one whose point count differs; returns those
        rebuilt."""
        for name in await asyncio.to_thread(self.index.collections):
            if name not in chunk_counts:
                log.warning("dropping index collection unknown to the database", collection=name)
                await asyncio.to_thread(self.index.drop, name)
        rebuilt = []
        for name, expected in chunk_counts.items():
            if await asyncio.to_thread(self.index.count, name) != expected:
                await self.rebuild(db, name)
                rebuilt.append(name)
        return rebuilt

    async def rebuild(self, db: Database, collection: str) -> None:
        """Drop ``collection`` from the index and write every chunk the database holds for it."""
        log.info("rebuilding index collection from the database", collection=collection)
        await asyncio.to_thread(self.index.drop, collection)
        after = ""
        total = 0
        while True:
            async with db.session() as session:
                rows = (
                    await session.execute(
                        chunks_with_documents(ChunkRow, DocumentRow.title, DocumentRow.meta)
                        .where(ChunkRow.collection == collection, ChunkRow.point_id > after)
                        .order_by(ChunkRow.point_id)
                        .limit(_REBUILD_BATCH)
                    )
                ).all()
            if not rows:
                break
            pending = [
                PendingPoint(c.point_id, c.tenant, c.document_id, c.chunk_index, title, c.text, meta)
                for c, title, meta in rows
            ]
            points = await asyncio.to_thread(self.points, pending)
            await asyncio.to_thread(self.index.upsert, collection, points)
            total += len(points)
            after = rows[-1][0].point_id
        log.info("index collection rebuilt", collection=collection, chunks=total)
