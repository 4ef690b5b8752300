"""Retriever domain logic: ingest documents into chunks, keep the index in step, search it.

The database owns documents and chunks; the index is derived from them. A write changes both
inside one database transaction — the index is written last, just before the commit, so a failed
index write loses nothing — and stages one ``DocumentChanged`` event per changed document in the
same transaction (outbox). Writes are serialised in-process: the embedded index belongs to this
process alone. At start-up :meth:`RetrieverService.reconcile_index` rebuilds any collection whose
index does not match the database.

Every call acts for one tenant (``forge_retriever.tenancy``): a document is keyed by (collection,
tenant, id), and reads, writes and the index queries are all scoped to the caller's tenant.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import hashlib
import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import sqlalchemy as sa
import structlog
from forge.events.v1 import events_pb2
from google.protobuf.message import Message
from prometheus_client import Counter, Histogram
from sqlalchemy.ext.asyncio import AsyncSession

from forge_kit import errors
from forge_kit.db import Database
from forge_kit.events import stage_event
from forge_retriever.chunking import HfTokenizer, TokenChunker
from forge_retriever.config import RetrieverSettings
from forge_retriever.embed import Embedder, bundled_minilm_path
from forge_retriever.index import Fusion, HybridParams, IndexHit, IndexPoint, VectorIndex, point_id
from forge_retriever.store import ChunkRow, CollectionRow, DocumentRow, SourceVersionRow, utcnow
from forge_retriever.tenancy import DEFAULT_TENANT, validate_tenant
from forge_retriever.text import Bm25Encoder

log = structlog.get_logger(__name__)

_COLLECTION_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
MAX_DOCUMENT_ID_CHARS = 512
MAX_TITLE_CHARS = 4096
MAX_METADATA_PAIRS = 64
MAX_METADATA_CHARS = 1024
_REBUILD_BATCH = 500


@dataclass(frozen=True)
class _PendingPoint:
    """A chunk to index: what ``_points`` needs to encode it (sparse) and embed it (dense)."""

    point_id: str
    tenant: str
    document_id: str
    chunk_index: int
    title: str
    text: str
    metadata: Mapping[str, str]


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


class ChangeOutcome(enum.Enum):
    """What became of a document-change event from the topic."""

    APPLIED = "applied"
    UNCHANGED = "unchanged"
    """Same content as held, or a delete of a document not held: nothing to do."""
    STALE = "stale"
    """A version at or below the newest already applied to the document."""
    OWN = "own"
    """The retriever's own event, recording a write it has already made."""


class SearchMode(enum.Enum):
    """How Search scores chunks."""

    HYBRID = "hybrid"
    DENSE = "dense"
    SPARSE = "sparse"


@dataclass(frozen=True)
class DocumentIn:
    """A document as a caller sends it."""

    id: str
    text: str
    title: str = ""
    metadata: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class UpsertResult:
    """Documents written (changed or new), chunks written for them, documents sent unchanged."""

    upserted: int
    chunks: int
    unchanged: int


@dataclass(frozen=True)
class SearchHit:
    """A chunk found by Search, with its document's metadata plus ``title``."""

    document_id: str
    chunk_id: str
    text: str
    score: float
    sparse_score: float
    dense_score: float
    metadata: dict[str, str]


@dataclass(frozen=True)
class SearchResult:
    """Hits best first; ``mode`` is how they were scored, which may differ from what was asked."""

    hits: list[SearchHit]
    mode: SearchMode
    dense_truncated: bool = False
    """The dense side embedded only the query's first ``max_dense_query_chars`` characters."""


@dataclass(frozen=True)
class CollectionStats:
    """A collection and its sizes."""

    name: str
    document_count: int
    chunk_count: int


def validate_collection(field_name: str, name: str) -> None:
    """Collection names become directory names of the index, so they are restricted."""
    if not name:
        raise errors.ValidationError(field_name, "must not be empty")
    if not _COLLECTION_NAME.fullmatch(name):
        raise errors.ValidationError(
            field_name,
            "must be letters, digits, '_', '-' or '.', start with a letter or digit, at most 128 characters",
        )


def validate_document(prefix: str, doc: DocumentIn, max_chars: int) -> None:
    """Reject a document that could not be indexed, naming the field (``documents[3].text``)."""
    if not doc.id:
        raise errors.ValidationError(f"{prefix}.id", "must not be empty")
    if len(doc.id) > MAX_DOCUMENT_ID_CHARS:
        raise errors.ValidationError(f"{prefix}.id", f"must be at most {MAX_DOCUMENT_ID_CHARS} characters")
    if not doc.text.strip():
        raise errors.ValidationError(f"{prefix}.text", "must not be empty")
    if len(doc.text) > max_chars:
        raise errors.ValidationError(f"{prefix}.text", f"must be at most {max_chars} characters")
    if len(doc.title) > MAX_TITLE_CHARS:
        raise errors.ValidationError(f"{prefix}.title", f"must be at most {MAX_TITLE_CHARS} characters")
    _validate_metadata(f"{prefix}.metadata", doc.metadata)
    if "title" in doc.metadata:
        raise errors.ValidationError(
            f"{prefix}.metadata.title", "is reserved: set the document's title field"
        )


def _validate_metadata(field_name: str, metadata: Mapping[str, str]) -> None:
    if len(metadata) > MAX_METADATA_PAIRS:
        raise errors.ValidationError(field_name, f"must have at most {MAX_METADATA_PAIRS} entries")
    for key, value in metadata.items():
        if not key:
            raise errors.ValidationError(field_name, "keys must not be empty")
        if len(key) > MAX_METADATA_CHARS or len(value) > MAX_METADATA_CHARS:
            raise errors.ValidationError(
                f"{field_name}.{key}", f"keys and values must be at most {MAX_METADATA_CHARS} characters"
            )


def content_hash(doc: DocumentIn, chunking: str) -> str:
    """Hash of everything that affects the stored document, its chunking included (``chunking``:
    the chunker's version); equal hashes make an upsert a no-op, so after a chunking change a
    document sent again unchanged is chunked anew."""
    body = json.dumps([doc.title, doc.text, sorted(doc.metadata.items()), chunking], ensure_ascii=False)
    return hashlib.sha256(body.encode("utf-8")).hexdigest()


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


def chunk_id(document_id: str, index: int) -> str:
    """Caller-facing chunk id, stable for a document and position."""
    return f"{document_id}#{index}"


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
        if index.dense_enabled != (embedder is not None):
            raise ValueError("an embedder is needed exactly when the index holds dense vectors")
        self._db = db
        self._index = index
        self._embedder = embedder
        self._hybrid = HybridParams(
            candidates=settings.hybrid_candidates, fusion=Fusion(settings.hybrid_fusion), rrf_k=settings.rrf_k
        )
        self._settings = settings
        self._producer = producer
        self._on_commit = on_commit
        self._encoder = sparse_encoder(settings)
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
        pending: list[_PendingPoint] = []
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
                    _upserted_event(collection, tenant, doc, row.version),
                    producer=self._producer,
                    key=f"{collection}/{doc.id}",
                )
            written += 1
        points: list[IndexPoint] = []
        if written:
            await session.flush()
            points = await asyncio.to_thread(self._points, pending)
            await asyncio.to_thread(
                functools.partial(self._index.delete_documents, collection, replaced, tenant=tenant)
            )
            await asyncio.to_thread(self._index.upsert, collection, points)
        return written, len(points)

    def _add_chunks(
        self, session: AsyncSession, collection: str, tenant: str, doc: DocumentIn
    ) -> list[_PendingPoint]:
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
            points.append(
                _PendingPoint(pid, tenant, doc.id, chunk.index, doc.title, chunk.text, doc.metadata)
            )
        return points

    def _points(self, pending: Sequence[_PendingPoint]) -> list[IndexPoint]:
        """Encode chunks for the index (blocking: embedding is CPU-bound, run it in a thread)."""
        # The title is indexed with every chunk: it is the densest statement of what the chunk is about.
        texts = [f"{p.title}\n{p.text}" if p.title else p.text for p in pending]
        dense: Sequence[Sequence[float] | None] = (
            self._embedder.embed_documents(texts) if self._embedder is not None else [None] * len(texts)
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
                event = events_pb2.DocumentChanged(
                    collection=collection,
                    document_id=doc_id,
                    change=events_pb2.DOCUMENT_CHANGE_TYPE_DELETED,
                    version=coll.last_version,
                    tenant=tenant,
                )
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

    async def handle_event(self, event: Message, session: AsyncSession) -> None:
        """The document-change consumer's handler (``forge_kit.events.EventConsumer``)."""
        if not isinstance(event, events_pb2.DocumentChanged):
            raise errors.ValidationError("event", f"{event.DESCRIPTOR.full_name} is not a DocumentChanged")
        await self.apply_document_changed(event, session)

    async def apply_document_changed(
        self, event: events_pb2.DocumentChanged, session: AsyncSession
    ) -> ChangeOutcome:
        """Apply a document change from the topic: the handler of the document-change consumer.

        Runs inside the consumer's transaction, which also records the event id (exactly-once with
        the kit's ``EventConsumer``); the document belongs to the event's ``tenant``, or to
        ``SOURCE_TENANT`` when the event names none.

        1. Skip the retriever's own events: they record writes it has already made.
        2. Validate as UpsertDocuments/DeleteDocuments do; a bad event raises ``ValidationError``
           (the consumer dead-letters it rather than stall the partition).
        3. Skip a version at or below the newest applied to this document (version 0: unversioned,
           always applied).
        4. Upsert or delete without staging an event (the topic already carries this change).
        5. Record the version, kept after a delete so that a late upsert cannot resurrect it.
        """
        if event.meta.producer == self._producer:
            SOURCE_CHANGES.labels(ChangeOutcome.OWN.value).inc()
            return ChangeOutcome.OWN
        collection, tenant = event.collection, event.tenant or self._source_tenant
        validate_collection("collection", collection)
        validate_tenant("tenant", tenant)
        if not event.document_id:
            raise errors.ValidationError("document_id", "must not be empty")
        upsert = event.change == events_pb2.DOCUMENT_CHANGE_TYPE_UPSERTED
        if not upsert and event.change != events_pb2.DOCUMENT_CHANGE_TYPE_DELETED:
            raise errors.ValidationError("change", f"must be UPSERTED or DELETED, not {event.change}")
        doc = DocumentIn(event.document_id, event.text, event.title, dict(event.metadata))
        if upsert:
            validate_document("document", doc, self._settings.max_document_chars)
        async with self._write_lock:
            held = await session.get(SourceVersionRow, (collection, tenant, event.document_id))
            if held is not None and event.version and event.version <= held.version:
                SOURCE_CHANGES.labels(ChangeOutcome.STALE.value).inc()
                return ChangeOutcome.STALE
            if upsert:
                changed = (await self._write_upsert(session, collection, tenant, [doc], publish=False))[0]
            else:
                changed = len(await self._write_delete(session, collection, tenant, [doc.id], publish=False))
            if held is None:
                held = SourceVersionRow(
                    collection=collection, tenant=tenant, document_id=event.document_id, version=0
                )
                session.add(held)
            # An unversioned event never lowers the mark a versioned one set.
            held.version = max(held.version, event.version)
            held.producer, held.applied_at = event.meta.producer, utcnow()
            await session.flush()
        outcome = ChangeOutcome.APPLIED if changed else ChangeOutcome.UNCHANGED
        SOURCE_CHANGES.labels(outcome.value).inc()
        if changed:
            CHANGES.labels("upserted" if upsert else "deleted").inc()
            if event.meta.HasField("occurred_at"):
                SOURCE_LAG.observe(max(0.0, time.time() - event.meta.occurred_at.ToNanoseconds() / 1e9))
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
        _validate_metadata("filter", metadata_filter)
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
            self._query_index, collection, tenant, query, top_k, served, dict(metadata_filter)
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
                    sa.select(
                        ChunkRow.point_id,
                        ChunkRow.chunk_id,
                        ChunkRow.text,
                        DocumentRow.id,
                        DocumentRow.title,
                        DocumentRow.meta,
                    )
                    .join(
                        DocumentRow,
                        sa.and_(
                            DocumentRow.collection == ChunkRow.collection,
                            DocumentRow.tenant == ChunkRow.tenant,
                            DocumentRow.id == ChunkRow.document_id,
                        ),
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

    def _query_index(
        self,
        collection: str,
        tenant: str,
        query: str,
        top_k: int,
        mode: SearchMode,
        metadata_filter: dict[str, str],
    ) -> list[IndexHit]:
        """Encode ``query`` as ``mode`` needs and search the index (blocking: runs in a thread)."""
        if mode is SearchMode.SPARSE or self._embedder is None:
            return self._index.search_sparse(
                collection, self._encoder.encode_query(query), top_k, metadata_filter, tenant=tenant
            )
        vector = self._embedder.embed_query(query[: self._settings.max_dense_query_chars])
        if mode is SearchMode.DENSE:
            return self._index.search_dense(collection, vector, top_k, metadata_filter, tenant=tenant)
        return self._index.search_hybrid(
            collection,
            self._encoder.encode_query(query),
            vector,
            top_k,
            metadata_filter,
            self._hybrid,
            tenant=tenant,
        )

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
        docs_q = sa.select(DocumentRow.collection, sa.func.count().label("n"))
        chunks_q = sa.select(ChunkRow.collection, sa.func.count().label("n"))
        if tenant is not None:
            validate_tenant("tenant", tenant)
            docs_q = docs_q.where(DocumentRow.tenant == tenant)
            chunks_q = chunks_q.where(ChunkRow.tenant == tenant)
        docs = docs_q.group_by(DocumentRow.collection).subquery()
        chunks = chunks_q.group_by(ChunkRow.collection).subquery()
        stmt = (
            sa.select(CollectionRow.name, docs.c.n, chunks.c.n)
            .outerjoin(docs, docs.c.collection == CollectionRow.name)
            .outerjoin(chunks, chunks.c.collection == CollectionRow.name)
            .order_by(CollectionRow.name)
        )
        if tenant is not None:
            # Another tenant's collection names are not this tenant's business.
            stmt = stmt.where(docs.c.n > 0)
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
            for name in await asyncio.to_thread(self._index.collections):
                if name not in stats:
                    log.warning("dropping index collection unknown to the database", collection=name)
                    await asyncio.to_thread(self._index.drop, name)
            rebuilt = []
            for name, expected in stats.items():
                if await asyncio.to_thread(self._index.count, name) != expected:
                    await self._rebuild(name)
                    rebuilt.append(name)
            self.index_ready = True
            return rebuilt

    async def _rebuild(self, collection: str) -> None:
        log.info("rebuilding index collection from the database", collection=collection)
        await asyncio.to_thread(self._index.drop, collection)
        after = ""
        total = 0
        while True:
            async with self._db.session() as session:
                rows = (
                    await session.execute(
                        sa.select(ChunkRow, DocumentRow.title, DocumentRow.meta)
                        .join(
                            DocumentRow,
                            sa.and_(
                                DocumentRow.collection == ChunkRow.collection,
                                DocumentRow.tenant == ChunkRow.tenant,
                                DocumentRow.id == ChunkRow.document_id,
                            ),
                        )
                        .where(ChunkRow.collection == collection, ChunkRow.point_id > after)
                        .order_by(ChunkRow.point_id)
                        .limit(_REBUILD_BATCH)
                    )
                ).all()
            if not rows:
                break
            pending = [
                _PendingPoint(c.point_id, c.tenant, c.document_id, c.chunk_index, title, c.text, meta)
                for c, title, meta in rows
            ]
            points = await asyncio.to_thread(self._points, pending)
            await asyncio.to_thread(self._index.upsert, collection, points)
            total += len(points)
            after = rows[-1][0].point_id
        log.info("index collection rebuilt", collection=collection, chunks=total)

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


def _upserted_event(
    collection: str, tenant: str, doc: DocumentIn, version: int
) -> events_pb2.DocumentChanged:
    return events_pb2.DocumentChanged(
        collection=collection,
        tenant=tenant,
        document_id=doc.id,
        change=events_pb2.DOCUMENT_CHANGE_TYPE_UPSERTED,
        version=version,
        title=doc.title,
        text=doc.text,
        metadata=dict(doc.metadata),
    )
