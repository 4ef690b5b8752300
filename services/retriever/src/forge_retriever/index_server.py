"""``VectorIndex`` on a Qdrant server through ``qdrant-client`` (docker compose, production).

The same collections and the same query shape as :class:`~forge_retriever.index.QdrantEdgeIndex`:
one Qdrant collection per Forge collection (named ``<prefix><collection>``) with the sparse vector
``bm25`` (IDF modifier), the dense vector ``dense`` (cosine, HNSW) when dense search is on, the
payload ``tenant``/``document_id`` (keyword indexes) and ``meta`` (keyword index of metadata pairs);
hybrid search is one ``query_points`` call with a dense and a sparse prefetch (each filtered) and
an RRF or DBSF fusion query over them. The schema (as Edge writes beside each shard) is kept in
the collection's metadata; a collection of another schema counts as absent and is rebuilt.

``qdrant-client``'s local mode (``QdrantClient(path=...)`` / ``":memory:"``) answers the same API
in-process; the tests use it, so they need no Qdrant server.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from qdrant_client import QdrantClient, models

from forge_retriever.index import (
    DENSE_VECTOR,
    SPARSE_VECTOR,
    Fusion,
    IndexHit,
    IndexPoint,
    IndexQuery,
    Nearest,
    SearchQueries,
    metadata_terms,
)
from forge_retriever.text import SparseVector

_UPSERT_BATCH = 256


@dataclass(frozen=True)
class CollectionLayout:
    """How the collections this index creates are laid out on the server (docs/DEPLOY.md sizes
    them for 100M documents). qdrant-client's local mode accepts and ignores all of it."""

    shards: int = 1
    replication_factor: int = 1
    write_consistency_factor: int = 1
    on_disk_payload: bool = True
    on_disk_vectors: bool = False
    quantization: str = "none"  # "none", "int8" or "binary"
    oversampling: float = 2.0

    def __post_init__(self) -> None:
        if self.quantization not in ("none", "int8", "binary"):
            raise ValueError(f"quantization must be none, int8 or binary, not {self.quantization!r}")
        if not 1 <= self.write_consistency_factor <= self.replication_factor:
            raise ValueError("write_consistency_factor must be between 1 and replication_factor")
        if self.shards < 1:
            raise ValueError("shards must be at least 1")

    def quantization_config(self) -> models.QuantizationConfig | None:
        """The quantized copy kept in RAM (``always_ram``) while the originals may sit on disk."""
        if self.quantization == "int8":
            return models.ScalarQuantization(
                scalar=models.ScalarQuantizationConfig(
                    type=models.ScalarType.INT8, quantile=0.99, always_ram=True
                )
            )
        if self.quantization == "binary":
            return models.BinaryQuantization(binary=models.BinaryQuantizationConfig(always_ram=True))
        return None

    def search_params(self) -> models.SearchParams | None:
        """Dense queries over quantized vectors rescore an oversampled candidate list."""
        if self.quantization == "none":
            return None
        return models.SearchParams(
            quantization=models.QuantizationSearchParams(rescore=True, oversampling=self.oversampling)
        )


class QdrantServerIndex(SearchQueries):
    """``VectorIndex`` on a Qdrant server (or qdrant-client's local mode): see the module docstring."""

    def __init__(
        self,
        client: QdrantClient,
        dense_dim: int | None = None,
        dense_version: str = "",
        sparse_version: str = "",
        *,
        prefix: str = "forge_",
        local: bool = False,
        layout: CollectionLayout | None = None,
    ) -> None:
        self._client = client
        self._prefix = prefix
        self._layout = layout or CollectionLayout()
        self._dense_dim = dense_dim
        self.dense_enabled = dense_dim is not None
        self._schema: dict[str, Any] = {
            "sparse": SPARSE_VECTOR,
            "sparse_version": sparse_version,
            "dense_dim": dense_dim,
            "dense_version": dense_version,
            "tenant": "tenant",
        }
        self._known: set[str] = set()
        # ``local``: qdrant-client's local mode, one in-process store not documented as thread-safe
        # (a server takes concurrent requests, so searches run in parallel there) and without
        # payload indexes (it filters by scanning).
        self._local = local
        self._guard: contextlib.AbstractContextManager[Any] = (
            threading.Lock() if local else contextlib.nullcontext()
        )

    @classmethod
    def connect(cls, url: str, api_key: str = "", **kwargs: Any) -> QdrantServerIndex:
        """``http(s)://host:port`` for a server; ``local:<folder>`` or ``local::memory:`` for local mode."""
        if url.startswith("local:"):
            location = url.removeprefix("local:")
            client = QdrantClient(":memory:") if location == ":memory:" else QdrantClient(path=location)
            return cls(client, local=True, **kwargs)
        if url.startswith(("http://", "https://")):
            client = QdrantClient(url=url, api_key=api_key or None, timeout=10)
        else:
            raise ValueError(f"qdrant url must be http(s)://… or local:<folder>, not {url!r}")
        return cls(client, **kwargs)

    def _name(self, collection: str) -> str:
        return self._prefix + collection

    def _exists(self, collection: str) -> bool:
        """True when the collection exists with this index's schema (cached once seen)."""
        if collection in self._known:
            return True
        name = self._name(collection)
        if not self._client.collection_exists(name):
            return False
        metadata = self._client.get_collection(name).config.metadata or {}
        if metadata.get("forge_schema") != self._schema:
            return False
        self._known.add(collection)
        return True

    def _create(self, collection: str) -> None:
        name = self._name(collection)
        # Absent, or of another schema (another model, or built BM25-only): start it afresh.
        if self._client.collection_exists(name):
            self._client.delete_collection(name)
        layout = self._layout
        dense = (
            {
                DENSE_VECTOR: models.VectorParams(
                    size=self._dense_dim, distance=models.Distance.COSINE, on_disk=layout.on_disk_vectors
                )
            }
            if self._dense_dim is not None
            else {}
        )
        sparse = models.SparseVectorParams(
            modifier=models.Modifier.IDF, index=models.SparseIndexParams(on_disk=layout.on_disk_vectors)
        )
        self._client.create_collection(
            name,
            vectors_config=dense,
            sparse_vectors_config={SPARSE_VECTOR: sparse},
            shard_number=layout.shards,
            replication_factor=layout.replication_factor,
            write_consistency_factor=layout.write_consistency_factor,
            on_disk_payload=layout.on_disk_payload,
            quantization_config=layout.quantization_config() if self._dense_dim is not None else None,
            metadata={"forge_schema": self._schema},
        )
        for field in () if self._local else ("tenant", "document_id", "meta"):
            self._client.create_payload_index(name, field, models.PayloadSchemaType.KEYWORD)
        self._known.add(collection)

    def collections(self) -> list[str]:
        with self._guard:
            names = [c.name for c in self._client.get_collections().collections]
            return sorted(
                n.removeprefix(self._prefix)
                for n in names
                if n.startswith(self._prefix) and self._exists(n.removeprefix(self._prefix))
            )

    def count(self, collection: str) -> int:
        with self._guard:
            if not self._exists(collection):
                return 0
            return int(self._client.count(self._name(collection), exact=True).count)

    def upsert(self, collection: str, points: Sequence[IndexPoint]) -> None:
        with self._guard:
            if not points:
                return
            if not self._exists(collection):
                self._create(collection)
            records = [
                models.PointStruct(
                    id=p.point_id,
                    vector=self._vectors(p),
                    payload={
                        "tenant": p.tenant,
                        "document_id": p.document_id,
                        "chunk_index": p.chunk_index,
                        "meta": metadata_terms(p.metadata),
                    },
                )
                for p in points
            ]
            for first in range(0, len(records), _UPSERT_BATCH):
                self._client.upsert(self._name(collection), records[first : first + _UPSERT_BATCH], wait=True)

    def _vectors(self, p: IndexPoint) -> dict[str, Any]:
        vectors: dict[str, Any] = {SPARSE_VECTOR: _sparse(p.sparse)}
        if self._dense_dim is not None:
            vectors[DENSE_VECTOR] = p.dense_of(self._dense_dim)
        return vectors

    def delete_documents(self, collection: str, document_ids: Iterable[str], *, tenant: str) -> None:
        with self._guard:
            ids = list(document_ids)
            if not ids or not self._exists(collection):
                return
            flt = models.Filter(
                must=[
                    models.FieldCondition(key="tenant", match=models.MatchValue(value=tenant)),
                    models.FieldCondition(key="document_id", match=models.MatchAny(any=ids)),
                ]
            )
            self._client.delete(
                self._name(collection), points_selector=models.FilterSelector(filter=flt), wait=True
            )

    def _run(self, collection: str, query: IndexQuery) -> list[IndexHit]:
        flt = _filter(query)
        if query.fusion is None:
            assert query.nearest is not None
            nearest = query.nearest
            return self._query(
                collection,
                query=_vector(nearest),
                using=nearest.using,
                limit=query.limit,
                flt=flt,
                params=self._search_params(nearest),
            )
        prefetch = [
            models.Prefetch(
                query=_vector(n), using=n.using, limit=n.limit, filter=flt, params=self._search_params(n)
            )
            for n in query.prefetch
        ]
        fusion: models.Query = (
            models.RrfQuery(rrf=models.Rrf(k=query.rrf_k))
            if query.fusion is Fusion.RRF
            else models.FusionQuery(fusion=models.Fusion.DBSF)
        )
        return self._query(
            collection, query=fusion, using=None, limit=query.limit, flt=flt, prefetch=prefetch
        )

    def _search_params(self, nearest: Nearest) -> models.SearchParams | None:
        """The layout's HNSW search parameters for a dense list (sparse lists need none)."""
        return self._layout.search_params() if nearest.using == DENSE_VECTOR else None

    def _query(
        self,
        collection: str,
        *,
        query: Any,
        using: str | None,
        limit: int,
        flt: models.Filter,
        prefetch: list[models.Prefetch] | None = None,
        params: models.SearchParams | None = None,
    ) -> list[IndexHit]:
        with self._guard:
            if not self._exists(collection):
                return []
            response = self._client.query_points(
                self._name(collection),
                query=query,
                using=using,
                prefetch=prefetch,
                query_filter=flt,
                search_params=params,
                limit=limit,
                with_payload=["document_id"],
            )
        return [
            IndexHit(str(p.id), str((p.payload or {}).get("document_id", "")), float(p.score))
            for p in response.points
        ]

    def drop(self, collection: str) -> None:
        with self._guard:
            self._known.discard(collection)
            if self._client.collection_exists(self._name(collection)):
                self._client.delete_collection(self._name(collection))

    def close(self) -> None:
        self._client.close()


def _sparse(vector: SparseVector) -> models.SparseVector:
    return models.SparseVector(indices=list(vector.indices), values=list(vector.values))


def _vector(nearest: Nearest) -> models.SparseVector | list[float]:
    vector = nearest.vector
    return _sparse(vector) if isinstance(vector, SparseVector) else list(vector)


def _filter(query: IndexQuery) -> models.Filter:
    """The tenant's points that match every metadata term (as ``index._filter``)."""
    conditions: list[models.Condition] = [
        models.FieldCondition(key="tenant", match=models.MatchValue(value=query.tenant))
    ]
    conditions += [
        models.FieldCondition(key="meta", match=models.MatchValue(value=term))
        for term in query.metadata_terms
    ]
    return models.Filter(must=conditions)
