"""The Qdrant server backend (``QdrantServerIndex``) behind the same ``VectorIndex`` seam.

These tests need no Qdrant server: they drive ``qdrant-client``'s local mode,
which answers the same ``query_points`` API (prefetch, RRF with k, DBSF, sparse IDF, filters); the
HTTP/gRPC transport to a real server and server-side payload indexes are not exercised here.
Each behaviour is checked against the Qdrant Edge index on the same points.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from qdrant_client import models

from forge_kit.db import Database
from forge_retriever.config import RetrieverSettings
from forge_retriever.documents import DocumentIn, SearchMode
from forge_retriever.index import Fusion, HybridParams, IndexPoint, QdrantEdgeIndex, VectorIndex, point_id
from forge_retriever.index_server import CollectionLayout, QdrantServerIndex
from forge_retriever.service import RetrieverService
from forge_retriever.text import SparseVector

if TYPE_CHECKING:
    from conftest import SciFactSample

MIGRATIONS = Path(__file__).parents[1] / "src" / "forge_retriever" / "migrations"
QUERY_SPARSE = SparseVector((7,), (1.0,))
QUERY_DENSE = [1.0, 0.0, 0.0]


def _unit(*v: float) -> list[float]:
    n = math.sqrt(sum(x * x for x in v))
    return [x / n for x in v]


def _points() -> list[IndexPoint]:
    rows = [
        ("a", _unit(1, 0, 0), 0.0, "acme"),
        ("b", _unit(1, 0.3, 0), 0.2, "acme"),
        ("c", _unit(1, 0.8, 0), 0.5, "globex"),
        ("d", _unit(1, 2, 0), 0.8, "acme"),
        ("e", _unit(0.2, 1, 1), 1.5, "acme"),
    ]
    return [
        IndexPoint(
            point_id=point_id("c", doc, 0, tenant),
            document_id=doc,
            chunk_index=0,
            sparse=SparseVector((7, 9), (w, 0.1)) if w else SparseVector((9,), (1.0,)),
            metadata={"group": "x" if doc in "ab" else "y"},
            dense=dense,
            tenant=tenant,
        )
        for doc, dense, w, tenant in rows
    ]


#: The layout docs/DEPLOY.md sizes for 100M documents (Kubernetes' retriever settings).
PRODUCTION = CollectionLayout(
    shards=12,
    replication_factor=2,
    write_consistency_factor=1,
    on_disk_payload=True,
    on_disk_vectors=True,
    quantization="int8",
    oversampling=2.0,
)


@pytest.fixture(params=["default-layout", "production-layout"])
def pair(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[VectorIndex, VectorIndex]]:
    """Edge and the server backend on the same points; every behaviour below is checked with the
    default layout and with the production one (quantized dense search with rescoring, on-disk
    vectors and payload: requests the server must accept)."""
    layout = PRODUCTION if request.param == "production-layout" else CollectionLayout()
    edge = QdrantEdgeIndex(tmp_path / "edge", dense_dim=3, dense_version="synthetic")
    server = QdrantServerIndex.connect(
        f"local:{tmp_path / 'qdrant'}", dense_dim=3, dense_version="synthetic", layout=layout
    )
    for idx in (edge, server):
        idx.upsert("c", _points())
    yield edge, server
    edge.close()
    server.close()


def _ranked(hits: list) -> dict[str, float]:  # type: ignore[type-arg]
    """Scores by document, best first checked; ties may come in either order in the two engines."""
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    return {h.document_id: round(h.score, 5) for h in hits}


@pytest.mark.parametrize("tenant", ["acme", "globex", "nobody"])
@pytest.mark.parametrize("flt", [{}, {"group": "y"}, {"group": "x"}])
def test_same_answers_as_edge_for_every_query_shape(
    pair: tuple[VectorIndex, VectorIndex], tenant: str, flt: dict[str, str]
) -> None:
    edge, server = pair
    assert _ranked(server.search_dense("c", QUERY_DENSE, 10, flt, tenant=tenant)) == _ranked(
        edge.search_dense("c", QUERY_DENSE, 10, flt, tenant=tenant)
    )
    assert _ranked(server.search_sparse("c", QUERY_SPARSE, 10, flt, tenant=tenant)) == _ranked(
        edge.search_sparse("c", QUERY_SPARSE, 10, flt, tenant=tenant)
    )
    for params in (HybridParams(candidates=10, rrf_k=60), HybridParams(candidates=10, rrf_k=5)):
        assert _ranked(
            server.search_hybrid("c", QUERY_SPARSE, QUERY_DENSE, 5, flt, params, tenant=tenant)
        ) == _ranked(edge.search_hybrid("c", QUERY_SPARSE, QUERY_DENSE, 5, flt, params, tenant=tenant))
    dbsf = HybridParams(fusion=Fusion.DBSF)
    assert {
        h.document_id
        for h in server.search_hybrid("c", QUERY_SPARSE, QUERY_DENSE, 5, flt, dbsf, tenant=tenant)
    } == {
        h.document_id for h in edge.search_hybrid("c", QUERY_SPARSE, QUERY_DENSE, 5, flt, dbsf, tenant=tenant)
    }


def test_rrf_scores_are_reciprocal_ranks(pair: tuple[VectorIndex, VectorIndex]) -> None:
    _, server = pair
    hits = server.search_hybrid(
        "c", QUERY_SPARSE, QUERY_DENSE, 5, {}, HybridParams(candidates=10), tenant="acme"
    )
    # acme's dense order a, b, d, e and sparse order e, d, b: e = 1/60 + 1/63, a = 1/60 only.
    scores = {h.document_id: h.score for h in hits}
    assert scores["e"] == pytest.approx(1 / 60 + 1 / 63) and scores["a"] == pytest.approx(1 / 60)
    assert "c" not in scores  # globex's point, nearer than e and d, never enters acme's lists


def test_deletes_counts_drop_and_schema(pair: tuple[VectorIndex, VectorIndex], tmp_path: Path) -> None:
    _, server = pair
    assert server.collections() == ["c"] and server.count("c") == 5
    server.delete_documents("c", ["c", "e"], tenant="acme")  # "c" is globex's: untouched
    assert server.count("c") == 4
    assert [h.document_id for h in server.search_dense("c", QUERY_DENSE, 10, {}, tenant="globex")] == ["c"]
    server.close()
    # Reopened with another embedder version, the collection counts as absent (to be rebuilt).
    other = QdrantServerIndex.connect(
        f"local:{tmp_path / 'qdrant'}", dense_dim=3, dense_version="another-model"
    )
    try:
        assert other.collections() == [] and other.count("c") == 0
        other.upsert("c", _points()[:1])
        assert other.count("c") == 1
        other.drop("c")
        assert other.collections() == []
    finally:
        other.close()


def test_the_layout_is_what_the_server_is_asked_to_create(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Local mode ignores shards, replication and quantization: what reaches a server is the
    create_collection request, recorded here on its way through to the real client."""
    server = QdrantServerIndex.connect(
        f"local:{tmp_path / 'qdrant'}", dense_dim=3, dense_version="synthetic", layout=PRODUCTION
    )
    client = server._client
    sent: list[dict[str, object]] = []
    create = client.create_collection

    def recording(name: str, **kwargs: object) -> bool:
        sent.append(kwargs)
        return create(name, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(client, "create_collection", recording)
    try:
        server.upsert("c", _points())
        [request] = sent
        assert (
            request["shard_number"],
            request["replication_factor"],
            request["write_consistency_factor"],
        ) == (
            12,
            2,
            1,
        )
        assert request["on_disk_payload"] is True
        quantization = request["quantization_config"]
        assert isinstance(quantization, models.ScalarQuantization)
        assert quantization.scalar.type == models.ScalarType.INT8 and quantization.scalar.always_ram
        # Local mode keeps the on-disk flags of the vectors: the originals are memory-mapped.
        params = client.get_collection("forge_c").config.params
        assert params.vectors["dense"].on_disk is True  # type: ignore[index]
        assert params.sparse_vectors["bm25"].index.on_disk is True  # type: ignore[index, union-attr]
    finally:
        server.close()


@pytest.mark.parametrize(
    ("layout", "complaint"),
    [
        ({"quantization": "pq"}, "quantization"),
        ({"replication_factor": 1, "write_consistency_factor": 2}, "write_consistency_factor"),
        ({"shards": 0}, "shards"),
    ],
)
def test_an_impossible_layout_is_refused(layout: dict[str, object], complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint):
        CollectionLayout(**layout)  # type: ignore[arg-type]


def test_settings_refuse_more_write_acks_than_replicas() -> None:
    with pytest.raises(ValueError, match="qdrant_write_consistency_factor"):
        RetrieverSettings(kafka_enabled=False, qdrant_replication_factor=1, qdrant_write_consistency_factor=2)


def test_bad_url_is_refused() -> None:
    with pytest.raises(ValueError, match="qdrant url"):
        QdrantServerIndex.connect("qdrant:6333")
    with pytest.raises(ValueError, match="qdrant_url"):
        RetrieverSettings(index_backend="qdrant", kafka_enabled=False)


async def test_service_on_the_server_backend_ranks_scifact_like_edge(
    tmp_path: Path,
    db: Database,
    settings: RetrieverSettings,
    scifact: SciFactSample,
    service: RetrieverService,
) -> None:
    server = QdrantServerIndex.connect(f"local:{tmp_path / 'qdrant-svc'}")
    try:
        other_db = Database(f"sqlite+aiosqlite:///{tmp_path / 'server.db'}")
        await other_db.migrate(MIGRATIONS)
        on_server = RetrieverService(other_db, server, settings)
        await on_server.reconcile_index()
        await service.upsert_documents("scifact", scifact.documents)
        await on_server.upsert_documents("scifact", scifact.documents)
        await on_server.upsert_documents("scifact", [DocumentIn(id="x", text="cancer cells")], tenant="acme")
        for query, _ in scifact.relevant.values():
            edge = (await service.search("scifact", query, 10, SearchMode.SPARSE, {})).hits
            server_hits = (await on_server.search("scifact", query, 10, SearchMode.SPARSE, {})).hits
            # The same scores rank by rank (acme's document moves the server's IDF a little), and
            # the same documents; chunks of exactly equal score may come in either order.
            assert [h.score for h in server_hits] == pytest.approx([h.score for h in edge], rel=0.01), query
            assert Counter(h.document_id for h in server_hits) == Counter(h.document_id for h in edge), query
            assert server_hits[0].document_id == edge[0].document_id
        await other_db.dispose()
    finally:
        server.close()
