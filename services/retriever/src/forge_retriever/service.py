"""Retriever domain logic: ingest documents into chunks, keep the index in step, search it.

The database owns documents and chunks; the index is derived from them. A write changes both
inside one database transaction — the index is written last, just before the commit, so a failed
index write loses nothing — and stages one ``DocumentChanged`` event per changed document in the
same transaction (outbox). Writes are serialised in-process: the embedded index belongs to this
process alone. At start-up :meth:`RetrieverService.reconcile_index` rebuilds any collection whose
index does not match the database.

Every call acts for one tenant (``forge_retriever.tenancy``): a document is keyed by (collection,
tenant, id), and reads, writes and the index queries are all scoped to the caller's tenant.

The service takes and returns the dataclasses of ``forge_retriever.documents``; ``api`` translates
the gRPC messages and ``messages`` the events.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Mapping, Sequence

import sqlalchemy as sa
import structlog
from prometheus_client import Counter, Histogram
from sqlalchemy.ext.asyncio import AsyncSession

from forge_kit import errors
from forge_kit.db import Database, utcnow
from forge_kit.events import stage_event
from forge_retriever.config import RetrieverSettings
from forge_retriever.documents import (
    ChangeKind,
    ChangeOutcome,
    CollectionStats,
    DocumentChange,
    DocumentIn,
    SearchHit,
    SearchMode,
    SearchResult,
    UpsertResult,
    chunk_id,
    content_hash,
    validate_collection,
    validate_document,
    validate_metadata,
)
from forge_retriever.embed import Embedder
from forge_retriever.index import IndexPoint, VectorIndex, point_id
from forge_retriever.indexing import IndexedChunks, PendingPoint, chunker_for
from forge_retriever.messages import deleted_event, upserted_event
from forge_retriever.store import (
    ChunkRow,
    CollectionRow,
    DocumentRow,
    SourceVersionRow,
    chunks_with_documents,
    collection_counts,
)
from forge_retriever.tenancy import DEFAULT_TENANT, validate_tenant

log = structlog.get_logger(__name__)

SEARCHES = Counter("forge_retriever_searches_total", "Searches served", ["requested_mode", "served_mode"])
CHANGES = Counter("forge_retriever_document_changes_total", "Documents written or removed", ["change"])
DENSE_TRUNCATED = Counter(
    "forge_retriever_dense_query_truncated_total",
    "Queries longer than MAX_DENSE_QUERY_CHARS whose embedding saw only their first characters",
)
SOURCE_CHANGES = Counter(
    "forge_retriever_source_changes_total", "Document-change events from the topic, by outcome", ["outcome"]
)
SOURCE_LAG = Histogram(
    "forge_retriever_source_lag_seconds",
    "From a document-change event's occurred_at to its change being committed to the index",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
)


class RetrieverService:
    """Owns the retriever's database and index; every public write is one transaction.

    With an ``embedder`` (and an index opened with dense vectors) every chunk is also embedded and
    DENSE and HYBRID search are served; without one the service is BM25 only.
    """

    def __init__(
        self,
        db: Database,
        index: VectorIndex,
        settings: RetrieverSettings,
        *,
        embedder: Embedder | None = None,
        producer: str = "retriever",
        on_commit: Callable[[], None] = lambda: None,
    ) -> None:
        self._chunks = IndexedChunks(index, settings, embedder)
        self._db = db
        self._index = index
        self._embedder = embedder
        self._settings = settings
        self._producer = producer
        self._on_commit = on_commit
        self._chunker = chunker_for(settings)
        self._write_lock = asyncio.Lock()
        self._source_tenant = settings.source_tenant
        self.index_ready = False

    # --- writes ------------------------------------------------------------------------------

    async def upsert_documents(
        self, collection: str, documents: Sequence[DocumentIn], *, tenant: str = DEFAULT_TENANT
    ) -> UpsertResult:
        """Add or replace ``tenant``'s documents: rows, chunks, index points and one UPSERTED event each.

        1. Validate the whole batch; nothing is written if any document is bad.
        2. Skip documents whose content is unchanged (no event, no index write).
        3. Replace the changed documents' rows and chunks and stage their events.
        4. Encode the new chunks (BM25, and embeddings in batches when dense is enabled).
        5. Replace their points in the index, then commit.
        """
        validate_collection("collection", collection)
        validate_tenant("tenant", tenant)
        self._validate_batch("documents", len(documents))
        seen: set[str] = set()
        for i, doc in enumerate(documents):
            validate_document(f"documents[{i}]", doc, self._settings.max_document_chars)
            if doc.id in seen:
                raise errors.ValidationError(f"documents[{i}].id", f"duplicate id {doc.id!r} in the request")
            seen.add(doc.id)

        async with self._write_lock, self._db.session() as session:
            written, chunks = await self._write_upsert(session, collection, tenant, documents, publish=True)
        if written:
            CHANGES.labels("upserted").inc(written)
            self._on_commit()
        return UpsertResult(upserted=written, chunks=chunks, unchanged=len(documents) - written)

    async def _write_upsert(
        self,
        session: AsyncSession,
        collection: str,
        tenant: str,
        documents: Sequence[DocumentIn],
        *,
        publish: bool,
    ) -> tuple[int, int]:
        """Steps 2-5 of an upsert inside ``session`` (the caller holds the write lock and commits).

        ``publish`` stages the UPSERTED events; returns (documents written, chunks written).
        """
        seen = {doc.id for doc in documents}
        coll = await session.get(CollectionRow, collection)
        if coll is None:
            coll = CollectionRow(name=collection, last_version=0, created_at=utcnow())
            session.add(coll)
            await session.flush()
        existing = {
            row.id: row
            for row in await session.scalars(
                sa.select(DocumentRow).where(
                    DocumentRow.collection == collection,
                    DocumentRow.tenant == tenant,
                    DocumentRow.id.in_(seen),
                )
            )
        }
        pending: list[PendingPoint] = []
        replaced: list[str] = []
        written = 0
        for doc in documents:
            digest = content_hash(doc, self._chunker.version)
            row = existing.get(doc.id)
            if row is not None and row.content_hash == digest:
                continue
            coll.last_version += 1
            now = utcnow()
            if row is None:
                row = DocumentRow(collection=collection, tenant=tenant, id=doc.id, created_at=now)
                session.add(row)
            else:
                replaced.append(doc.id)
                await session.execute(
                    sa.delete(ChunkRow).where(
                        ChunkRow.collection == collection,
                        ChunkRow.tenant == tenant,
                        ChunkRow.document_id == doc.id,
                    )
                )
            row.title, row.text, row.meta = doc.title, doc.text, dict(doc.metadata)
            row.version, row.content_hash, row.updated_at = coll.last_version, digest, now
            await session.flush()
            pending.extend(self._add_chunks(session, collection, tenant, doc))
            if publish:
                await stage_event(
                    session,
                    upserted_event(collection, tenant, doc, row.version),
                    producer=self._producer,
                    key=f"{collection}/{doc.id}",
                )
            written += 1
        points: list[IndexPoint] = []
        if written:
            await session.flush()
            points = await asyncio.to_thread(self._chunks.points, pending)
            await asyncio.to_thread(
                functools.partial(self._index.delete_documents, collection, replaced, tenant=tenant)
            )
            await asyncio.to_thread(self._index.upsert, collection, points)
        return written, len(points)

    def _add_chunks(
        self, session: AsyncSession, collection: str, tenant: str, doc: DocumentIn
    ) -> list[PendingPoint]:
        points = []
        for chunk in self._chunker.chunk(doc.text):
            pid = point_id(collection, doc.id, chunk.index, tenant)
            session.add(
                ChunkRow(
                    point_id=pid,
                    collection=collection,
                    tenant=tenant,
                    document_id=doc.id,
                    chunk_index=chunk.index,
                    chunk_id=chunk_id(doc.id, chunk.index),
                    text=chunk.text,
                    start_char=chunk.start,
                    end_char=chunk.end,
                )
            )
            points.append(PendingPoint(pid, tenant, doc.id, chunk.index, doc.title, chunk.text, doc.metadata))
        return points

    async def delete_documents(
        self, collection: str, ids: Sequence[str], *, tenant: str = DEFAULT_TENANT
    ) -> int:
        """Remove ``tenant``'s documents with all their chunks and index points; one DELETED event each.

        Ids that do not exist (for this tenant) are ignored; the count says how many did.
        """
        validate_collection("collection", collection)
        validate_tenant("tenant", tenant)
        self._validate_batch("ids", len(ids))
        for i, doc_id in enumerate(ids):
            if not doc_id:
                raise errors.ValidationError(f"ids[{i}]", "must not be empty")
        async with self._write_lock, self._db.session() as session:
            await self._collection(session, collection, tenant)
            found = await self._write_delete(session, collection, tenant, ids, publish=True)
        if found:
            CHANGES.labels("deleted").inc(len(found))
            self._on_commit()
        return len(found)

    async def _write_delete(
        self, session: AsyncSession, collection: str, tenant: str, ids: Sequence[str], *, publish: bool
    ) -> list[str]:
        """A delete inside ``session`` (the caller holds the write lock and commits).

        ``publish`` stages the DELETED events; returns the ids that existed and were removed.
        """
        coll = await session.get(CollectionRow, collection)
        if coll is None:
            return []
        found = list(
            await session.scalars(
                sa.select(DocumentRow.id).where(
                    DocumentRow.collection == collection,
                    DocumentRow.tenant == tenant,
                    DocumentRow.id.in_(set(ids)),
                )
            )
        )
        for doc_id in found:
            coll.last_version += 1
            if publish:
                event = deleted_event(collection, tenant, doc_id, coll.last_version)
                await stage_event(session, event, producer=self._producer, key=f"{collection}/{doc_id}")
        if found:
            await session.execute(
                sa.delete(ChunkRow).where(
                    ChunkRow.collection == collection,
                    ChunkRow.tenant == tenant,
                    ChunkRow.document_id.in_(found),
                )
            )
            await session.execute(
                sa.delete(DocumentRow).where(
                    DocumentRow.collection == collection,
                    DocumentRow.tenant == tenant,
                    DocumentRow.id.in_(found),
                )
            )
            await session.flush()
            await asyncio.to_thread(
                functools.partial(self._index.delete_documents, collection, found, tenant=tenant)
            )
        return found

    async def apply_document_change(self, change: DocumentChange, session: AsyncSession) -> ChangeOutcome:
        """Apply a document change from the topic (the document-change consumer's handler,
        ``api.document_change_handler``, calls this with the event it read).

        Runs inside the consumer's transaction, which also records the event id (exactly-once with
        the kit's ``EventConsumer``); the document belongs to the event's ``tenant``, or to
        ``SOURCE_TENANT`` when the event names none.

        1. Skip the retriever's own events: they record writes it has already made.
        2. Validate as UpsertDocuments/DeleteDocuments do; a bad event raises ``ValidationError``
           (the consumer dead-letters it rather than stall the partition).
        3. Skip a version at or below the newest applied to this document; an unversioned change
           (version 0) that happened before the newest applied one (the events' signed
           ``occurred_at``): a replayed old event cannot resurrect a deleted document.
        4. Upsert or delete without staging an event (the topic already carries this change).
        5. Record the version and event time, kept after a delete so that a late upsert cannot
           resurrect it.
        """
        if change.producer == self._producer:
            SOURCE_CHANGES.labels(ChangeOutcome.OWN.value).inc()
            return ChangeOutcome.OWN
        collection, tenant = change.collection, change.tenant or self._source_tenant
        validate_collection("collection", collection)
        validate_tenant("tenant", tenant)
        if not change.document_id:
            raise errors.ValidationError("document_id", "must not be empty")
        if change.kind is None:
            raise errors.ValidationError("change", f"must be UPSERTED or DELETED, not {change.unknown_kind}")
        upsert = change.kind is ChangeKind.UPSERTED
        doc = DocumentIn(change.document_id, change.text, change.title, dict(change.metadata))
        if upsert:
            validate_document("document", doc, self._settings.max_document_chars)
        async with self._write_lock:
            held = await session.get(SourceVersionRow, (collection, tenant, change.document_id))
            if held is not None and _is_stale(change, held):
                SOURCE_CHANGES.labels(ChangeOutcome.STALE.value).inc()
                return ChangeOutcome.STALE
            if upsert:
                changed = (await self._write_upsert(session, collection, tenant, [doc], publish=False))[0]
            else:
                changed = len(await self._write_delete(session, collection, tenant, [doc.id], publish=False))
            if held is None:
                held = SourceVersionRow(
                    collection=collection, tenant=tenant, document_id=change.document_id, version=0
                )
                session.add(held)
            # An unversioned event never lowers the mark a versioned one set.
            held.version = max(held.version, change.version)
            held.producer, held.applied_at = change.producer, utcnow()
            if change.occurred_at is not None:
                held.occurred_at = max(held.occurred_at or 0.0, change.occurred_at)
            await session.flush()
        outcome = ChangeOutcome.APPLIED if changed else ChangeOutcome.UNCHANGED
        SOURCE_CHANGES.labels(outcome.value).inc()
        if changed:
            CHANGES.labels("upserted" if upsert else "deleted").inc()
            if change.occurred_at is not None:
                SOURCE_LAG.observe(max(0.0, time.time() - change.occurred_at))
        return outcome

    # --- reads -------------------------------------------------------------------------------

    async def search(
        self,
        collection: str,
        query: str,
        top_k: int,
        mode: SearchMode,
        metadata_filter: Mapping[str, str],
        *,
        tenant: str = DEFAULT_TENANT,
    ) -> SearchResult:
        """Top-k chunks of ``tenant``'s documents in ``collection`` for ``query``, best first.

        ``metadata_filter`` narrows within the tenant's chunks; it cannot widen past them.

        1. Validate; resolve top_k 0 to the default.
        2. Pick the scoring the index can serve: DENSE needs the dense index; HYBRID without it is
           served by BM25 alone and the result says so.
        3. Encode the query (BM25 terms of the whole query; the embedding, through the query cache,
           of its first ``max_dense_query_chars`` characters, a cut counted) and query the index;
           HYBRID is one index query fusing the dense and sparse candidate lists.
        4. Order equal scores by point id; read the hits' chunks and documents from the database (the
           source of truth; a point the database no longer has is dropped).
        """
        validate_collection("collection", collection)
        validate_tenant("tenant", tenant)
        if not query.strip():
            raise errors.ValidationError("query", "must not be empty")
        if len(query) > self._settings.max_query_chars:
            raise errors.ValidationError(
                "query", f"must be at most {self._settings.max_query_chars} characters"
            )
        if top_k == 0:
            top_k = self._settings.default_top_k
        if not 1 <= top_k <= self._settings.max_top_k:
            raise errors.ValidationError(
                "top_k", f"must be between 1 and {self._settings.max_top_k} (0: server default)"
            )
        validate_metadata("filter", metadata_filter)
        async with self._db.session() as session:
            await self._collection(session, collection, tenant)

        dense_enabled = self._embedder is not None
        if mode is SearchMode.DENSE and not dense_enabled:
            raise errors.ConflictError(
                "dense index not enabled: search with mode SPARSE (or HYBRID, served by BM25)"
            )
        served = mode if dense_enabled else SearchMode.SPARSE
        if mode is SearchMode.HYBRID and not dense_enabled:
            log.info("hybrid search served by BM25 alone: dense index not enabled", collection=collection)
        SEARCHES.labels(mode.value, served.value).inc()
        truncated = served is not SearchMode.SPARSE and len(query) > self._settings.max_dense_query_chars
        if truncated:
            DENSE_TRUNCATED.inc()
        hits = await asyncio.to_thread(
            self._chunks.query, collection, tenant, query, top_k, served, dict(metadata_filter)
        )
        if not hits:
            return SearchResult([], served, truncated)
        # Equal scores are common under RRF (ranks (1, 3) and (3, 1) fuse alike) and the engine
        # orders them differently from process to process: break ties by point id, so the same
        # index answers the same query the same way (SciFact's hybrid nDCG@10 moved by 0.005).
        hits.sort(key=lambda h: (-h.score, h.point_id))
        # Only the columns a hit needs, as plain rows: ORM objects (and the documents' whole
        # texts) for 100 hits cost ~17 ms a query, most of a BM25 search.
        async with self._db.session() as session:
            rows = (
                await session.execute(
                    chunks_with_documents(
                        ChunkRow.point_id,
                        ChunkRow.chunk_id,
                        ChunkRow.text,
                        DocumentRow.id,
                        DocumentRow.title,
                        DocumentRow.meta,
                    )
                    # The tenant again: the database, not only the index, keeps tenants apart.
                    .where(ChunkRow.point_id.in_([h.point_id for h in hits]), ChunkRow.tenant == tenant)
                )
            ).all()
        by_point = {row.point_id: row for row in rows}
        results = []
        for hit in hits:
            row = by_point.get(hit.point_id)
            if row is None:
                continue
            results.append(
                SearchHit(
                    document_id=row.id,
                    chunk_id=row.chunk_id,
                    text=row.text,
                    score=hit.score,
                    # A fused score has no components the engine reports: 0 means "not computed".
                    sparse_score=hit.score if served is SearchMode.SPARSE else 0.0,
                    dense_score=hit.score if served is SearchMode.DENSE else 0.0,
                    metadata={**row.meta, "title": row.title},
                )
            )
        return SearchResult(results, served, truncated)

    @property
    def embedder(self) -> Embedder | None:
        """The dense embedder (None when the index is BM25 only); ``Embed`` serves it directly."""
        return self._embedder

    @property
    def embedding_model(self) -> str:
        """Name of the embedding model; empty when dense search is off."""
        return self._embedder.name if self._embedder is not None else ""

    @property
    def embedding_dimension(self) -> int:
        """Length of the dense vectors; 0 when dense search is off."""
        return self._embedder.dimension if self._embedder is not None else 0

    async def list_collections(self, *, tenant: str | None = DEFAULT_TENANT) -> list[CollectionStats]:
        """Collections with ``tenant``'s documents in them and their counts for that tenant.

        ``tenant=None`` (start-up reconciliation only, never a caller) lists every collection with
        the counts of all tenants together.
        """
        if tenant is not None:
            validate_tenant("tenant", tenant)
        stmt = collection_counts(tenant)
        async with self._db.session() as session:
            return [
                CollectionStats(name, int(d or 0), int(c or 0))
                for name, d, c in (await session.execute(stmt)).all()
            ]

    # --- index maintenance -------------------------------------------------------------------

    async def reconcile_index(self) -> list[str]:
        """Make the index match the database; returns the collections rebuilt.

        1. Drop index collections the database does not have.
        2. Rebuild every collection whose point count differs from its chunk count (a missing or
           emptied index directory, or a crash between an index write and its commit).
        """
        async with self._write_lock:
            stats = {c.name: c.chunk_count for c in await self.list_collections(tenant=None)}
            rebuilt = await self._chunks.reconcile(self._db, stats)
            self.index_ready = True
            return rebuilt

    # --- helpers -----------------------------------------------------------------------------

    def _validate_batch(self, field_name: str, size: int) -> None:
        if size == 0:
            raise errors.ValidationError(field_name, "must not be empty")
        if size > self._settings.max_documents_per_request:
            raise errors.ValidationError(
                field_name, f"must have at most {self._settings.max_documents_per_request} entries"
            )

    @staticmethod
    async def _collection(session: AsyncSession, name: str, tenant: str) -> None:
        """A collection exists for a tenant while it holds that tenant's documents (as
        :meth:`list_collections` says): another tenant's collection answers exactly as a missing
        one does, so its existence does not leak."""
        held = await session.scalar(
            sa.select(DocumentRow.id)
            .where(DocumentRow.collection == name, DocumentRow.tenant == tenant)
            .limit(1)
        )
        if held is None:
            raise errors.ValidationError("collection", f"unknown collection {name!r}")


def _is_stale(change: DocumentChange, held: SourceVersionRow) -> bool:
    """Whether ``change`` is older than what was applied to its document: by version, or, for
    an unversioned change, by when it happened."""
    if change.version:
        return change.version <= held.version
    return (
        change.occurred_at is not None
        and held.occurred_at is not None
        and change.occurred_at < held.occurred_at
    )
