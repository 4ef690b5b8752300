"""The search index of chunks: the ``VectorIndex`` seam and its Qdrant Edge implementation.

The database is the source of truth for documents and chunks; the index holds only what search
needs (vectors, the owning document id, filterable metadata) and can always be rebuilt from it.
"""

from __future__ import annotations

import abc
import enum
import json
import shutil
import threading
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import qdrant_edge as qe

from forge_retriever.tenancy import DEFAULT_TENANT
from forge_retriever.text import SparseVector

SPARSE_VECTOR = "bm25"
DENSE_VECTOR = "dense"
#: Written beside each shard: what its vectors are, so a shard built for another embedding model
#: (or without dense vectors) is seen as missing and rebuilt rather than searched with wrong vectors.
_SCHEMA_FILE = "forge_schema.json"
_POINT_NAMESPACE = uuid.UUID("6b1f9a52-3d0e-4c35-9a44-0f3e2a8c9d71")


def point_id(collection: str, document_id: str, chunk_index: int, tenant: str = DEFAULT_TENANT) -> str:
    """Stable point id of a chunk: the same (collection, tenant, document, position) is the same point.

    The default tenant's ids leave the tenant out, so they are the ids chunks had before tenants.
    """
    key = (
        [collection, document_id, chunk_index]
        if tenant == DEFAULT_TENANT
        else [collection, tenant, document_id, chunk_index]
    )
    return str(uuid.uuid5(_POINT_NAMESPACE, json.dumps(key)))


def metadata_terms(metadata: Mapping[str, str]) -> list[str]:
    """One keyword per metadata pair, so an exact-match filter never depends on key syntax."""
    return [json.dumps([k, v], ensure_ascii=False) for k, v in sorted(metadata.items())]


@dataclass(frozen=True)
class IndexPoint:
    """One chunk as the index stores it."""

    point_id: str
    document_id: str
    chunk_index: int
    sparse: SparseVector
    metadata: Mapping[str, str] = field(default_factory=dict)
    dense: Sequence[float] | None = None
    tenant: str = DEFAULT_TENANT

    def dense_of(self, dim: int) -> list[float]:
        """The point's dense vector, which an index of ``dim``-float dense vectors needs; a
        :class:`ValueError` naming the point when it has none of that size (both backends)."""
        if self.dense is None or len(self.dense) != dim:
            raise ValueError(f"point {self.point_id} needs a dense vector of {dim} floats")
        return list(self.dense)


class Fusion(enum.Enum):
    """How a hybrid query merges its dense and sparse candidate lists."""

    RRF = "rrf"
    """Reciprocal rank fusion: sum of 1/(k + rank) over the lists; ignores score scales."""
    DBSF = "dbsf"
    """Distribution-based score fusion: each list's scores normalised by mean ± 3σ, then summed."""


@dataclass(frozen=True)
class HybridParams:
    """A hybrid query's shape: candidates taken from each list before fusion, and the fusion."""

    candidates: int = 100
    fusion: Fusion = Fusion.RRF
    rrf_k: int = 60


@dataclass(frozen=True)
class IndexHit:
    """A search result: the chunk's point id and its score (higher is better)."""

    point_id: str
    document_id: str
    score: float


class VectorIndex(Protocol):
    """Where chunks are searched. One index holds many collections.

    Called by ``RetrieverService`` only: ``upsert``/``delete_documents`` while the database
    transaction that writes the same chunks is still open (a failed index write rolls it back),
    ``search_sparse``/``search_dense``/``search_hybrid`` on every Search, ``count``/``drop``/
    ``collections`` at start-up to check the index against the database and rebuild what differs.
    Methods block; the service calls them from a worker thread, one write at a time. When
    ``dense_enabled`` is false points carry no dense vector and only ``search_sparse`` is called.

    Tenant isolation is the index's contract, not the caller's care: every search and delete takes
    the tenant, and sees only that tenant's points whatever ``metadata_filter`` holds (the tenant
    condition is ANDed with it inside the engine's query).
    """

    dense_enabled: bool

    def collections(self) -> list[str]:
        """Names of the collections the index holds."""

    def count(self, collection: str) -> int:
        """Points in ``collection``; 0 when it does not exist."""

    def upsert(self, collection: str, points: Sequence[IndexPoint]) -> None:
        """Insert or replace points by id, creating the collection on first use."""

    def delete_documents(self, collection: str, document_ids: Iterable[str], *, tenant: str) -> None:
        """Remove every point of the given documents of ``tenant`` (no error for unknown ones)."""

    def search_sparse(
        self,
        collection: str,
        query: SparseVector,
        limit: int,
        metadata_filter: Mapping[str, str],
        *,
        tenant: str,
    ) -> list[IndexHit]:
        """Best ``limit`` points of ``tenant`` by BM25 (IDF applied by the index) whose metadata has every pair."""

    def search_dense(
        self,
        collection: str,
        query: Sequence[float],
        limit: int,
        metadata_filter: Mapping[str, str],
        *,
        tenant: str,
    ) -> list[IndexHit]:
        """Best ``limit`` points of ``tenant`` by cosine similarity of their dense vector (approximate, HNSW)."""

    def search_hybrid(
        self,
        collection: str,
        sparse: SparseVector,
        dense: Sequence[float],
        limit: int,
        metadata_filter: Mapping[str, str],
        params: HybridParams,
        *,
        tenant: str,
    ) -> list[IndexHit]:
        """Best ``limit`` points of the fusion of the dense and the sparse candidate lists."""

    def drop(self, collection: str) -> None:
        """Delete the collection and its files."""

    def close(self) -> None:
        """Flush and release everything."""


@dataclass(frozen=True)
class Nearest:
    """The ``limit`` points nearest to ``vector`` by the named vector ``using``."""

    using: str
    vector: SparseVector | tuple[float, ...]
    limit: int


@dataclass(frozen=True)
class IndexQuery:
    """One search as every backend runs it: the points of ``tenant`` whose metadata holds every
    term of ``metadata_terms`` (the filter, also on each prefetch), ranked by ``nearest``, or, with
    ``fusion`` set, by the fusion of the ``prefetch`` candidate lists inside the engine."""

    tenant: str
    metadata_terms: tuple[str, ...]
    limit: int
    nearest: Nearest | None = None
    prefetch: tuple[Nearest, ...] = ()
    fusion: Fusion | None = None
    rrf_k: int = 60


class SearchQueries(abc.ABC):
    """The searches of :class:`VectorIndex`, built once for both backends: each subclass runs an
    :class:`IndexQuery` in :meth:`_run`, translating it into its client's types."""

    _dense_dim: int | None

    def search_sparse(
        self,
        collection: str,
        query: SparseVector,
        limit: int,
        metadata_filter: Mapping[str, str],
        *,
        tenant: str,
    ) -> list[IndexHit]:
        if not query:
            return []
        return self._run(
            collection, _query(tenant, metadata_filter, limit, nearest=Nearest(SPARSE_VECTOR, query, limit))
        )

    def search_dense(
        self,
        collection: str,
        query: Sequence[float],
        limit: int,
        metadata_filter: Mapping[str, str],
        *,
        tenant: str,
    ) -> list[IndexHit]:
        self._require_dense()
        return self._run(
            collection,
            _query(tenant, metadata_filter, limit, nearest=Nearest(DENSE_VECTOR, tuple(query), limit)),
        )

    def search_hybrid(
        self,
        collection: str,
        sparse: SparseVector,
        dense: Sequence[float],
        limit: int,
        metadata_filter: Mapping[str, str],
        params: HybridParams,
        *,
        tenant: str,
    ) -> list[IndexHit]:
        self._require_dense()
        candidates = max(limit, params.candidates)
        prefetch = [Nearest(DENSE_VECTOR, tuple(dense), candidates)]
        if sparse:  # a query of stop characters only has no terms: dense alone then
            prefetch.append(Nearest(SPARSE_VECTOR, sparse, candidates))
        return self._run(
            collection,
            _query(
                tenant,
                metadata_filter,
                limit,
                prefetch=tuple(prefetch),
                fusion=params.fusion,
                rrf_k=params.rrf_k,
            ),
        )

    def _require_dense(self) -> None:
        if self._dense_dim is None:
            raise RuntimeError("this index was opened without dense vectors")

    @abc.abstractmethod
    def _run(self, collection: str, query: IndexQuery) -> list[IndexHit]:
        """The hits of ``query`` in ``collection``, by the backend's own client."""


def _query(tenant: str, metadata_filter: Mapping[str, str], limit: int, **shape: Any) -> IndexQuery:
    """The tenant's points that match every metadata pair exactly.

    The caller's pairs only ever add ``must`` conditions on the ``meta`` field, beside the one on
    ``tenant``: a filter can narrow the tenant's points, never reach another tenant's.
    """
    if not tenant:
        raise ValueError("a tenant is required")
    return IndexQuery(tenant, tuple(metadata_terms(metadata_filter)), limit, **shape)


class QdrantEdgeIndex(SearchQueries):
    """``VectorIndex`` on Qdrant Edge: one embedded ``EdgeShard`` per collection under ``root``.

    Each shard has the sparse vector ``bm25`` with Qdrant's IDF modifier, the dense vector ``dense``
    (cosine, HNSW) when ``dense_dim`` is given, and the payload ``tenant`` (keyword index, in every
    query and delete), ``document_id`` (keyword index, for deletes), ``chunk_index`` and ``meta``
    (keyword index of metadata pairs, for filters). Shards are write-ahead-logged, so an acknowledged update survives a
    crash. A lock serialises calls: an ``EdgeShard`` is not documented as thread-safe.

    Hybrid search is one Qdrant query: two prefetches (dense and sparse, each with the filter) and a
    fusion query (``Fusion.Rrf`` or ``Fusion.Dbsf``) over them, so fusion happens inside the engine.
    ``dense_version`` (the embedder's version) and ``sparse_version`` (the BM25 encoder's) are
    recorded beside each shard; a shard recorded with another schema is treated as absent, so
    start-up reconciliation rebuilds it.
    """

    def __init__(
        self,
        root: str | Path,
        dense_dim: int | None = None,
        dense_version: str = "",
        sparse_version: str = "",
    ) -> None:
        self._root = Path(root)
        self._root.mkdir(parents=True, exist_ok=True)
        self._shards: dict[str, qe.EdgeShard] = {}
        self._lock = threading.Lock()
        self._dense_dim = dense_dim
        self.dense_enabled = dense_dim is not None
        # "tenant": shards built before points carried a tenant lack it and are rebuilt.
        self._schema = {
            "sparse": SPARSE_VECTOR,
            "sparse_version": sparse_version,
            "dense_dim": dense_dim,
            "dense_version": dense_version,
            "tenant": "tenant",
        }

    def _compatible(self, path: Path) -> bool:
        try:
            return bool(json.loads((path / _SCHEMA_FILE).read_text()) == self._schema)
        except (OSError, ValueError):
            return False

    def _path(self, collection: str) -> Path:
        return self._root / collection

    def _open(self, collection: str, *, create: bool) -> qe.EdgeShard | None:
        shard = self._shards.get(collection)
        if shard is not None:
            return shard
        path = self._path(collection)
        if (path / "edge_config.json").exists() and self._compatible(path):
            shard = qe.EdgeShard.load(str(path))
        elif create:
            # A half-created directory from a crash, or a shard of another schema.
            shutil.rmtree(path, ignore_errors=True)
            dense = (
                {DENSE_VECTOR: qe.EdgeVectorParams(size=self._dense_dim, distance=qe.Distance.Cosine)}
                if self._dense_dim is not None
                else None
            )
            config = qe.EdgeConfig(
                vectors=dense,
                sparse_vectors={SPARSE_VECTOR: qe.EdgeSparseVectorParams(modifier=qe.Modifier.Idf)},
            )
            shard = qe.EdgeShard.create(str(path), config)
            shard.update(qe.UpdateOperation.create_field_index("tenant", qe.PayloadSchemaType.Keyword))
            shard.update(qe.UpdateOperation.create_field_index("document_id", qe.PayloadSchemaType.Keyword))
            shard.update(qe.UpdateOperation.create_field_index("meta", qe.PayloadSchemaType.Keyword))
            (path / _SCHEMA_FILE).write_text(json.dumps(self._schema))
        else:
            return None
        self._shards[collection] = shard
        return shard

    def collections(self) -> list[str]:
        with self._lock:
            return sorted(
                p.parent.name for p in self._root.glob("*/edge_config.json") if self._compatible(p.parent)
            )

    def count(self, collection: str) -> int:
        with self._lock:
            shard = self._open(collection, create=False)
            return 0 if shard is None else int(shard.count(qe.CountRequest(exact=True)))

    def upsert(self, collection: str, points: Sequence[IndexPoint]) -> None:
        if not points:
            return
        records = [
            qe.Point(
                p.point_id,
                self._vectors(p),
                {
                    "tenant": p.tenant,
                    "document_id": p.document_id,
                    "chunk_index": p.chunk_index,
                    "meta": metadata_terms(p.metadata),
                },
            )
            for p in points
        ]
        with self._lock:
            shard = self._open(collection, create=True)
            assert shard is not None
            shard.update(qe.UpdateOperation.upsert_points(records))

    def _vectors(self, p: IndexPoint) -> dict[str, list[float] | qe.SparseVector | list[list[float]]]:
        vectors: dict[str, list[float] | qe.SparseVector | list[list[float]]] = {
            SPARSE_VECTOR: qe.SparseVector(list(p.sparse.indices), list(p.sparse.values))
        }
        if self._dense_dim is not None:
            vectors[DENSE_VECTOR] = p.dense_of(self._dense_dim)
        return vectors

    def delete_documents(self, collection: str, document_ids: Iterable[str], *, tenant: str) -> None:
        ids = list(document_ids)
        if not ids:
            return
        with self._lock:
            shard = self._open(collection, create=False)
            if shard is None:
                return
            conditions: list[qe.ConditionType] = [
                qe.FieldCondition("tenant", match=qe.MatchValue(tenant)),
                qe.FieldCondition("document_id", match=qe.MatchAny(ids)),
            ]
            shard.update(qe.UpdateOperation.delete_points_by_filter(qe.Filter(must=conditions)))

    def _run(self, collection: str, query: IndexQuery) -> list[IndexHit]:
        flt = _filter(query)
        if query.fusion is None:
            assert query.nearest is not None
            request = qe.QueryRequest(
                limit=query.limit, query=_nearest(query.nearest), filter=flt, with_payload=["document_id"]
            )
        else:
            # The stubs type the fusion query as ``Fusion`` although its variants are what is passed.
            fusion: qe.Fusion = (
                qe.Fusion.Rrf(k=query.rrf_k) if query.fusion is Fusion.RRF else qe.Fusion.Dbsf()  # type: ignore[assignment]
            )
            prefetches = [qe.Prefetch(limit=n.limit, query=_nearest(n), filter=flt) for n in query.prefetch]
            request = qe.QueryRequest(
                limit=query.limit,
                query=fusion,
                prefetches=prefetches,
                filter=flt,
                with_payload=["document_id"],
            )
        with self._lock:
            shard = self._open(collection, create=False)
            if shard is None:
                return []
            points = shard.query(request)
        return [
            IndexHit(str(p.id), str((p.payload or {}).get("document_id", "")), float(p.score)) for p in points
        ]

    def drop(self, collection: str) -> None:
        with self._lock:
            shard = self._shards.pop(collection, None)
            if shard is not None:
                shard.close()
            shutil.rmtree(self._path(collection), ignore_errors=True)

    def close(self) -> None:
        with self._lock:
            for shard in self._shards.values():
                shard.flush()
                shard.close()
            self._shards.clear()


def _sparse(vector: SparseVector) -> qe.SparseVector:
    return qe.SparseVector(list(vector.indices), list(vector.values))


def _nearest(nearest: Nearest) -> qe.Query:
    vector = nearest.vector
    return qe.Query.Nearest(
        _sparse(vector) if isinstance(vector, SparseVector) else list(vector), using=nearest.using
    )


def _filter(query: IndexQuery) -> qe.Filter:
    """``tenant`` and every metadata term (see :func:`_query`)."""
    conditions: list[qe.ConditionType] = [qe.FieldCondition("tenant", match=qe.MatchValue(query.tenant))]
    conditions += [qe.FieldCondition("meta", match=qe.MatchValue(term)) for term in query.metadata_terms]
    return qe.Filter(must=conditions)
