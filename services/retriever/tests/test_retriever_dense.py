"""Dense and hybrid search: RRF/DBSF fusion in Qdrant Edge on hand-made vectors, and the real MiniLM."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from forge_kit.db import Database
from forge_retriever.config import RetrieverSettings
from forge_retriever.documents import DocumentIn, SearchMode
from forge_retriever.embed import SentenceTransformerEmbedder
from forge_retriever.index import Fusion, HybridParams, IndexPoint, QdrantEdgeIndex, point_id
from forge_retriever.service import RetrieverService
from forge_retriever.tenancy import DEFAULT_TENANT
from forge_retriever.text import SparseVector

T = DEFAULT_TENANT

# --- fusion on synthetic lists ------------------------------------------------------------------


def _unit(*xs: float) -> list[float]:
    norm = math.sqrt(sum(x * x for x in xs))
    return [x / norm for x in xs]


def _synthetic(tmp_path: Path) -> QdrantEdgeIndex:
    """Five points whose dense and sparse orders for the test query disagree, by construction."""
    idx = QdrantEdgeIndex(tmp_path / "idx", dense_dim=3, dense_version="synthetic")
    # (doc, dense vector, weight of term 7, tenant): dense order a>b>c>d>e, sparse order e>d>c>b (a has no term).
    rows = [
        ("a", _unit(1, 0, 0), 0.0, "t1"),
        ("b", _unit(1, 0.3, 0), 0.2, "t1"),
        ("c", _unit(1, 0.8, 0), 0.5, "t2"),
        ("d", _unit(1, 2, 0), 0.8, "t1"),
        ("e", _unit(0.2, 1, 1), 1.5, "t1"),
    ]
    idx.upsert(
        "c",
        [
            IndexPoint(
                point_id=point_id("c", doc, 0),
                document_id=doc,
                chunk_index=0,
                sparse=SparseVector((7, 9), (w, 0.1)) if w else SparseVector((9,), (1.0,)),
                metadata={"tenant": tenant},
                dense=dense,
            )
            for doc, dense, w, tenant in rows
        ],
    )
    return idx


QUERY_SPARSE = SparseVector((7,), (1.0,))
QUERY_DENSE = [1.0, 0.0, 0.0]


def test_rrf_fuses_the_two_lists_by_reciprocal_rank(tmp_path: Path) -> None:
    idx = _synthetic(tmp_path)
    try:
        dense = [h.document_id for h in idx.search_dense("c", QUERY_DENSE, 10, {}, tenant=T)]
        sparse = [h.document_id for h in idx.search_sparse("c", QUERY_SPARSE, 10, {}, tenant=T)]
        assert dense == ["a", "b", "c", "d", "e"] and sparse == ["e", "d", "c", "b"]
        k = 60
        expected = {
            doc: sum(1.0 / (k + lst.index(doc)) for lst in (dense, sparse) if doc in lst) for doc in dense
        }
        hits = idx.search_hybrid(
            "c", QUERY_SPARSE, QUERY_DENSE, 5, {}, HybridParams(candidates=10, rrf_k=k), tenant=T
        )
        assert {h.document_id: h.score for h in hits} == pytest.approx(expected, rel=1e-5)
        ranked = [h.document_id for h in hits]
        assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
        assert ranked[0] == "e"  # 1/60 + 1/64 beats "b" and "d" at 1/61 + 1/63 each
        # The dense list's head, absent from the sparse list, falls to last place.
        assert ranked[-1] == "a"
    finally:
        idx.close()


def test_hybrid_candidates_cut_each_list_before_fusion(tmp_path: Path) -> None:
    idx = _synthetic(tmp_path)
    try:
        hits = idx.search_hybrid(
            "c", QUERY_SPARSE, QUERY_DENSE, 5, {}, HybridParams(candidates=1, rrf_k=60), tenant=T
        )
        # limit wins over a smaller candidate count: each list contributes max(limit, candidates).
        assert len(hits) == 5
        one = idx.search_hybrid(
            "c", QUERY_SPARSE, QUERY_DENSE, 1, {}, HybridParams(candidates=1, rrf_k=60), tenant=T
        )
        assert [h.document_id for h in one] in (["a"], ["e"])  # the two list heads tie at 1/60
    finally:
        idx.close()


def test_dbsf_and_filters_apply_to_both_lists(tmp_path: Path) -> None:
    idx = _synthetic(tmp_path)
    try:
        hits = idx.search_hybrid(
            "c", QUERY_SPARSE, QUERY_DENSE, 10, {"tenant": "t2"}, HybridParams(fusion=Fusion.DBSF), tenant=T
        )
        assert [h.document_id for h in hits] == ["c"]
        dbsf = idx.search_hybrid(
            "c", QUERY_SPARSE, QUERY_DENSE, 5, {}, HybridParams(fusion=Fusion.DBSF), tenant=T
        )
        assert {h.document_id for h in dbsf} == {"a", "b", "c", "d", "e"}
    finally:
        idx.close()


def test_points_without_a_dense_vector_are_refused(tmp_path: Path) -> None:
    idx = QdrantEdgeIndex(tmp_path / "idx", dense_dim=3)
    try:
        point = IndexPoint(point_id("c", "x", 0), "x", 0, SparseVector((1,), (1.0,)))
        with pytest.raises(ValueError, match="dense vector of 3 floats"):
            idx.upsert("c", [point])
    finally:
        idx.close()


# --- the real MiniLM ----------------------------------------------------------------------------

DOCS = [
    DocumentIn(id="bp", text="Physicians recommend regular physical exercise to lower blood pressure."),
    DocumentIn(id="stocks", text="Equity markets fell sharply after the quarterly earnings report."),
    DocumentIn(id="volcano", text="Volcanic eruptions release ash and sulphur dioxide into the atmosphere."),
    DocumentIn(id="bread", text="Knead the dough, let it rise overnight, and bake it in a hot oven."),
]
# No word in common with the "bp" document: BM25 cannot find it.
PARAPHRASE = "doctors advise working out for hypertension"


async def test_dense_finds_a_paraphrase_that_bm25_misses(dense_service: RetrieverService) -> None:
    await dense_service.upsert_documents("c", DOCS)
    sparse = await dense_service.search("c", PARAPHRASE, 4, SearchMode.SPARSE, {})
    assert "bp" not in [h.document_id for h in sparse.hits]
    dense = await dense_service.search("c", PARAPHRASE, 4, SearchMode.DENSE, {})
    assert dense.mode is SearchMode.DENSE
    assert dense.hits[0].document_id == "bp" and dense.hits[0].dense_score > dense.hits[1].dense_score
    hybrid = await dense_service.search("c", PARAPHRASE, 4, SearchMode.HYBRID, {})
    assert hybrid.mode is SearchMode.HYBRID and hybrid.hits[0].document_id == "bp"


async def test_hybrid_keeps_exact_term_matches_and_filters(dense_service: RetrieverService) -> None:
    docs = [
        DocumentIn(id=d.id, text=d.text, metadata={"tenant": "t1" if d.id != "bread" else "t2"}) for d in DOCS
    ]
    await dense_service.upsert_documents("c", docs)
    hits = (await dense_service.search("c", "sulphur dioxide", 2, SearchMode.HYBRID, {})).hits
    assert hits[0].document_id == "volcano"
    only_t2 = await dense_service.search("c", PARAPHRASE, 4, SearchMode.HYBRID, {"tenant": "t2"})
    assert [h.document_id for h in only_t2.hits] == ["bread"]


async def test_sparse_only_index_is_rebuilt_with_embeddings(
    tmp_path: Path, db: Database, settings: RetrieverSettings, minilm: SentenceTransformerEmbedder
) -> None:
    sparse_index = QdrantEdgeIndex(tmp_path / "shared-index")
    sparse_svc = RetrieverService(db, sparse_index, settings)
    await sparse_svc.upsert_documents("c", DOCS)
    sparse_index.close()

    dense_index = QdrantEdgeIndex(
        tmp_path / "shared-index", dense_dim=minilm.dimension, dense_version=minilm.version
    )
    try:
        assert dense_index.collections() == []  # a shard of another schema is not this index's
        svc = RetrieverService(db, dense_index, settings, embedder=minilm)
        assert await svc.reconcile_index() == ["c"]
        assert dense_index.count("c") == len(DOCS)
        hits = (await svc.search("c", PARAPHRASE, 1, SearchMode.DENSE, {})).hits
        assert [h.document_id for h in hits] == ["bp"]
    finally:
        dense_index.close()


def test_query_embeddings_are_cached_and_unit_length(minilm: SentenceTransformerEmbedder) -> None:
    hits = minilm.cache_hits
    first = minilm.embed_query("cache me")
    second = minilm.embed_query("cache me")
    assert second == first and minilm.cache_hits == hits + 1
    assert len(first) == minilm.dimension == 384
    assert math.isclose(sum(x * x for x in first), 1.0, rel_tol=1e-4)
    batch = minilm.embed_documents(["cache me", "something else entirely"])
    assert batch[0] == pytest.approx(first, abs=1e-5)


def test_service_refuses_an_index_and_embedder_that_disagree(
    tmp_path: Path, minilm: SentenceTransformerEmbedder, settings: RetrieverSettings
) -> None:
    idx = QdrantEdgeIndex(tmp_path / "x")
    try:
        with pytest.raises(ValueError, match="embedder"):
            RetrieverService(Database("sqlite+aiosqlite://"), idx, settings, embedder=minilm)
    finally:
        idx.close()
