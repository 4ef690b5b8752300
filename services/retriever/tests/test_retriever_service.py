"""RetrieverService on a real SQLite database and a real Qdrant Edge index in a temp directory."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import sqlalchemy as sa
from forge.events.v1 import events_pb2

from forge_kit import errors
from forge_kit.db import Database
from forge_kit.events import OutboxEvent
from forge_retriever.config import RetrieverSettings
from forge_retriever.documents import DocumentIn, SearchMode
from forge_retriever.index import QdrantEdgeIndex
from forge_retriever.indexing import sparse_encoder
from forge_retriever.service import RetrieverService
from forge_retriever.store import ChunkRow

if TYPE_CHECKING:
    from conftest import SciFactSample

SPARSE, HYBRID, DENSE = SearchMode.SPARSE, SearchMode.HYBRID, SearchMode.DENSE


async def events(db: Database) -> list[events_pb2.DocumentChanged]:
    async with db.session() as session:
        rows = (await session.scalars(sa.select(OutboxEvent).order_by(OutboxEvent.sequence))).all()
    return [events_pb2.DocumentChanged.FromString(r.payload) for r in rows]


async def chunk_count(db: Database) -> int:
    async with db.session() as session:
        return int(await session.scalar(sa.select(sa.func.count()).select_from(ChunkRow)) or 0)


async def top_ids(
    service: RetrieverService, query: str, k: int = 10, collection: str = "scifact"
) -> list[str]:
    result = await service.search(collection, query, k, SPARSE, {})
    return [h.document_id for h in result.hits]


# --- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("collection", "docs", "field"),
    [
        ("", [DocumentIn(id="a", text="x")], "collection"),
        ("../etc", [DocumentIn(id="a", text="x")], "collection"),
        ("c", [], "documents"),
        ("c", [DocumentIn(id="", text="x")], "documents[0].id"),
        ("c", [DocumentIn(id="a", text="x"), DocumentIn(id="b", text="  \n")], "documents[1].text"),
        ("c", [DocumentIn(id="a", text="x"), DocumentIn(id="a", text="y")], "documents[1].id"),
        ("c", [DocumentIn(id="a", text="x", metadata={"title": "t"})], "documents[0].metadata.title"),
    ],
)
async def test_bad_upsert_names_the_field_and_writes_nothing(
    service: RetrieverService,
    db: Database,
    index: QdrantEdgeIndex,
    collection: str,
    docs: list[DocumentIn],
    field: str,
) -> None:
    with pytest.raises(errors.ValidationError) as caught:
        await service.upsert_documents(collection, docs)
    assert caught.value.field == field
    assert await service.list_collections() == []
    assert await chunk_count(db) == 0 and await events(db) == [] and index.collections() == []


async def test_bad_search_names_the_field(service: RetrieverService) -> None:
    await service.upsert_documents("c", [DocumentIn(id="a", text="some text")])
    cases = [
        (("", "q", 5), "collection"),
        (("missing", "q", 5), "collection"),
        (("c", "   ", 5), "query"),
        (("c", "q" * 70_000, 5), "query"),  # past MAX_QUERY_CHARS (65,536)
        (("c", "q", 1001), "top_k"),
    ]
    for (collection, query, top_k), field in cases:
        with pytest.raises(errors.ValidationError) as caught:
            await service.search(collection, query, top_k, SPARSE, {})
        assert caught.value.field == field, (collection, query[:10], top_k)


async def test_bad_delete_names_the_field(service: RetrieverService) -> None:
    await service.upsert_documents("c", [DocumentIn(id="a", text="some text")])
    for (collection, ids), field in [
        (("", ["a"]), "collection"),
        (("c", []), "ids"),
        (("c", ["a", ""]), "ids[1]"),
    ]:
        with pytest.raises(errors.ValidationError) as caught:
            await service.delete_documents(collection, ids)
        assert caught.value.field == field
    assert await top_ids(service, "text", collection="c") == ["a"]


# --- ingestion and events -----------------------------------------------------------------------


async def test_upsert_stages_events_and_same_content_is_a_no_op(
    service: RetrieverService, db: Database
) -> None:
    docs = [
        DocumentIn(id="a", text="alpha beta", title="A", metadata={"lang": "en"}),
        DocumentIn(id="b", text="gamma"),
    ]
    first = await service.upsert_documents("c", docs)
    assert (first.upserted, first.chunks, first.unchanged) == (2, 2, 0)
    again = await service.upsert_documents("c", docs)
    assert (again.upserted, again.chunks, again.unchanged) == (0, 0, 2)
    staged = await events(db)
    assert [(e.document_id, e.change, e.version) for e in staged] == [
        ("a", events_pb2.DOCUMENT_CHANGE_TYPE_UPSERTED, 1),
        ("b", events_pb2.DOCUMENT_CHANGE_TYPE_UPSERTED, 2),
    ]
    assert (
        staged[0].title == "A"
        and staged[0].text == "alpha beta"
        and dict(staged[0].metadata) == {"lang": "en"}
    )
    assert staged[0].meta.event_id and staged[0].meta.producer == "retriever"


async def test_update_replaces_exactly_the_old_chunks(
    service: RetrieverService, db: Database, index: QdrantEdgeIndex, settings: RetrieverSettings
) -> None:
    long_text = " ".join(f"word{i}" for i in range(200)) + " zebra"
    result = await service.upsert_documents("c", [DocumentIn(id="a", text=long_text)])
    assert result.chunks > 3 and index.count("c") == result.chunks == await chunk_count(db)
    assert await top_ids(service, "zebra", collection="c") == ["a"]

    await service.upsert_documents("c", [DocumentIn(id="a", text="a short giraffe text")])
    assert index.count("c") == 1 == await chunk_count(db)
    assert await top_ids(service, "zebra", collection="c") == []
    hit = (await service.search("c", "giraffe", 5, SPARSE, {})).hits[0]
    assert (hit.document_id, hit.chunk_id, hit.text) == ("a", "a#0", "a short giraffe text")
    assert [e.version for e in await events(db)] == [1, 2]


async def test_delete_removes_rows_points_and_stages_deleted(
    service: RetrieverService, db: Database, index: QdrantEdgeIndex
) -> None:
    await service.upsert_documents(
        "c", [DocumentIn(id="a", text="red apple"), DocumentIn(id="b", text="red car")]
    )
    assert await service.delete_documents("c", ["a", "nope"]) == 1
    assert await top_ids(service, "red", collection="c") == ["b"]
    assert index.count("c") == 1 == await chunk_count(db)
    last = (await events(db))[-1]
    assert (last.document_id, last.change, last.version) == ("a", events_pb2.DOCUMENT_CHANGE_TYPE_DELETED, 3)
    # Re-creating a deleted document continues the collection's version sequence.
    await service.upsert_documents("c", [DocumentIn(id="a", text="red apple")])
    assert (await events(db))[-1].version == 4
    stats = await service.list_collections()
    assert [(s.name, s.document_count, s.chunk_count) for s in stats] == [("c", 2, 2)]


# --- search -------------------------------------------------------------------------------------


async def test_metadata_filter_and_title_in_results(service: RetrieverService) -> None:
    await service.upsert_documents(
        "c",
        [
            DocumentIn(
                id="en", text="solar panel efficiency", title="Solar", metadata={"lang": "en", "a.b": "1"}
            ),
            DocumentIn(id="fr", text="solar panel rendement", metadata={"lang": "fr"}),
        ],
    )
    both = await service.search("c", "solar panel", 10, SPARSE, {})
    assert {h.document_id for h in both.hits} == {"en", "fr"}
    only = await service.search("c", "solar panel", 10, SPARSE, {"lang": "fr"})
    assert [h.document_id for h in only.hits] == ["fr"]
    dotted = await service.search("c", "solar", 10, SPARSE, {"a.b": "1", "lang": "en"})
    assert [(h.document_id, h.metadata) for h in dotted.hits] == [
        ("en", {"lang": "en", "a.b": "1", "title": "Solar"})
    ]
    assert (await service.search("c", "solar", 10, SPARSE, {"lang": "de"})).hits == []


async def test_rare_terms_outrank_common_ones(service: RetrieverService) -> None:
    # IDF is applied by Qdrant: "the" is everywhere, "mitochondria" in one document.
    docs = [DocumentIn(id=f"d{i}", text=f"the the the cell number {i}") for i in range(5)]
    docs.append(DocumentIn(id="m", text="the mitochondria"))
    await service.upsert_documents("c", docs)
    assert (await top_ids(service, "the mitochondria", collection="c"))[0] == "m"


async def test_dense_is_refused_and_hybrid_falls_back_to_sparse(service: RetrieverService) -> None:
    await service.upsert_documents("c", [DocumentIn(id="a", text="some text")])
    with pytest.raises(errors.ConflictError, match="dense index not enabled"):
        await service.search("c", "text", 5, DENSE, {})
    result = await service.search("c", "text", 5, HYBRID, {})
    assert result.mode is SPARSE and [h.document_id for h in result.hits] == ["a"]
    assert result.hits[0].sparse_score == result.hits[0].score > 0 and result.hits[0].dense_score == 0


# --- real documents, restart and rebuild ----------------------------------------------------------


async def test_scifact_queries_find_their_relevant_documents(
    service: RetrieverService, scifact: SciFactSample
) -> None:
    result = await service.upsert_documents("scifact", scifact.documents)
    assert result.upserted == len(scifact.documents)
    for query_id, (query, relevant) in scifact.relevant.items():
        top = await top_ids(service, query)
        assert relevant & set(top), f"query {query_id} {query!r}: none of {relevant} in top 10 {top}"
        # 50 documents make a top 10 easy to hit by chance; BM25 ranks these first.
        assert top[0] in relevant, f"query {query_id} {query!r}: top hit {top[0]} is not relevant"


async def test_deleted_document_leaves_the_results(service: RetrieverService, scifact: SciFactSample) -> None:
    await service.upsert_documents("scifact", scifact.documents)
    query, relevant = next(iter(scifact.relevant.values()))
    assert relevant & set(await top_ids(service, query))
    await service.delete_documents("scifact", sorted(relevant))
    assert not relevant & set(await top_ids(service, query, k=1000))


async def test_restart_and_rebuild_from_the_database(
    tmp_path: Path, db: Database, index: QdrantEdgeIndex, settings: RetrieverSettings, scifact: SciFactSample
) -> None:
    service = RetrieverService(db, index, settings)
    assert await service.reconcile_index() == []
    await service.upsert_documents("scifact", scifact.documents)
    query, relevant = next(iter(scifact.relevant.values()))
    before = await top_ids(service, query)
    assert relevant & set(before)
    index.close()

    # A new process on the same data_dir: the persisted index is used as it is.
    reopened = QdrantEdgeIndex(tmp_path / "index")
    restarted = RetrieverService(db, reopened, settings)
    assert await restarted.reconcile_index() == []
    assert await top_ids(restarted, query) == before
    reopened.close()

    # The index directory is lost: it is rebuilt from the database's chunks.
    shutil.rmtree(tmp_path / "index")
    rebuilt_index = QdrantEdgeIndex(tmp_path / "index")
    rebuilt = RetrieverService(db, rebuilt_index, settings)
    assert not rebuilt.index_ready
    assert await rebuilt.reconcile_index() == ["scifact"]
    assert rebuilt.index_ready and rebuilt_index.count("scifact") == await chunk_count(db)
    assert await top_ids(rebuilt, query) == before
    rebuilt_index.close()


async def test_an_index_of_another_bm25_encoding_is_rebuilt(
    tmp_path: Path, db: Database, settings: RetrieverSettings
) -> None:
    """Vectors of unstemmed words searched with stemmed queries would miss: a shard recorded with
    another encoder's version is rebuilt from the database, not searched."""
    plain = settings.model_copy(update={"bm25_language": "none"})
    old_index = QdrantEdgeIndex(tmp_path / "bm25", sparse_version=sparse_encoder(plain).version)
    await RetrieverService(db, old_index, plain).upsert_documents(
        "c", [DocumentIn(id="t", text="tumours suppressed")]
    )
    old_index.close()

    index = QdrantEdgeIndex(tmp_path / "bm25", sparse_version=sparse_encoder(settings).version)
    try:
        assert index.collections() == []
        service = RetrieverService(db, index, settings)
        assert await service.reconcile_index() == ["c"]
        assert await top_ids(service, "tumour suppression", collection="c") == ["t"]
    finally:
        index.close()


async def test_a_document_sent_again_after_a_chunking_change_is_chunked_anew(
    db: Database, index: QdrantEdgeIndex, settings: RetrieverSettings
) -> None:
    doc = DocumentIn(id="long", text=" ".join(f"Sentence number {i} is here." for i in range(40)))
    first = RetrieverService(db, index, settings)
    assert (await first.upsert_documents("c", [doc])).upserted == 1
    assert (await first.upsert_documents("c", [doc])).unchanged == 1  # same content, same chunking
    before = await chunk_count(db)
    smaller = RetrieverService(
        db, index, settings.model_copy(update={"chunk_tokens": 32, "chunk_overlap_tokens": 8})
    )
    result = await smaller.upsert_documents("c", [doc])
    assert result.upserted == 1 and await chunk_count(db) > before
    assert index.count("c") == await chunk_count(db)


async def test_reconcile_drops_index_collections_the_database_lacks(
    service: RetrieverService, index: QdrantEdgeIndex
) -> None:
    from forge_retriever.index import IndexPoint
    from forge_retriever.text import Bm25Encoder

    index.upsert(
        "orphan",
        [IndexPoint("00000000-0000-0000-0000-000000000001", "x", 0, Bm25Encoder().encode_document("x"))],
    )
    assert index.collections() == ["orphan"]
    assert await service.reconcile_index() == []
    assert index.collections() == []
