"""Tenant isolation: a tenant never sees, changes or deletes another tenant's chunks.

Two tenants write documents with the same ids into the same collection; every attempt of one to
reach the other's chunks — through filters on the metadata the other uses, on payload field names
of the index, in every search mode, through deletes, over gRPC with a forged header — must fail.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from forge.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from sqlalchemy.engine import Connection

from forge_kit import errors
from forge_kit.db import Database
from forge_kit.grpckit import (
    FIELD_METADATA_KEY,
    SERVICE_PRINCIPAL,
    GrpcServer,
    Principal,
    make_channel,
)
from forge_kit.testing.grpcserver import grpc_test_server
from forge_retriever.api import RetrieverApi
from forge_retriever.config import RetrieverSettings
from forge_retriever.documents import DocumentIn, SearchMode
from forge_retriever.index import QdrantEdgeIndex, point_id
from forge_retriever.service import RetrieverService
from forge_retriever.store import ChunkRow, DocumentRow
from forge_retriever.tenancy import DEFAULT_TENANT, TENANT_METADATA_KEY, caller_tenant

MIGRATIONS = Path(__file__).parents[1] / "src" / "forge_retriever" / "migrations"
TOKEN = "test-token"

# Same ids, same collection, same words: only the tenant tells them apart.
ACME = [
    DocumentIn(
        id="plan",
        title="Roadmap",
        text="acme secret roadmap for the solar panel launch",
        metadata={"owner": "acme", "lang": "en"},
    ),
    DocumentIn(
        id="memo", text="acme memo about solar panel pricing", metadata={"owner": "acme", "lang": "en"}
    ),
]
GLOBEX = [
    DocumentIn(
        id="plan",
        title="Roadmap",
        text="globex secret roadmap for the solar panel launch",
        metadata={"owner": "globex", "lang": "en"},
    ),
    DocumentIn(
        id="only-globex",
        text="globex solar panel merger",
        metadata={"owner": "globex", "lang": "en", "tenant": "acme"},
    ),
]

# Filters a tenant might send to reach the other's chunks: the other's metadata, the index's own
# payload field names (tenant, document_id, meta), and keys shaped like filter syntax.
ESCAPES = [
    {},
    {"owner": "globex"},
    {"tenant": "globex"},
    {"tenant": "acme"},
    {"document_id": "only-globex"},
    {"meta": '["owner", "globex"]'},
    {"owner": "globex", "tenant": "globex"},
    {"should": "owner=globex"},
    {"$or": "owner=globex"},
    {"lang": "en"},
]


async def _ingest(service: RetrieverService) -> None:
    await service.upsert_documents("shared", ACME, tenant="acme")
    await service.upsert_documents("shared", GLOBEX, tenant="globex")


def _texts(result_hits: list) -> set[str]:  # type: ignore[type-arg]
    return {h.text for h in result_hits}


@pytest.mark.parametrize("metadata_filter", ESCAPES)
async def test_no_filter_reaches_another_tenants_chunks(
    service: RetrieverService, metadata_filter: dict[str, str]
) -> None:
    await _ingest(service)
    result = await service.search(
        "shared", "globex solar panel roadmap merger", 50, SearchMode.SPARSE, metadata_filter, tenant="acme"
    )
    assert all("globex" not in h.text for h in result.hits)
    assert all(h.metadata.get("owner") == "acme" for h in result.hits)
    # The filters that acme's own documents satisfy do find them: the search itself works.
    assert bool(result.hits) == (metadata_filter in ({}, {"lang": "en"}))
    globex = await service.search(
        "shared", "acme solar panel roadmap memo", 50, SearchMode.SPARSE, metadata_filter, tenant="globex"
    )
    assert all("acme" not in h.text for h in globex.hits)


async def test_each_tenant_finds_its_own_document_of_the_same_id(service: RetrieverService) -> None:
    await _ingest(service)
    acme = await service.search("shared", "secret roadmap", 10, SearchMode.SPARSE, {}, tenant="acme")
    globex = await service.search("shared", "secret roadmap", 10, SearchMode.SPARSE, {}, tenant="globex")
    assert (acme.hits[0].document_id, acme.hits[0].text.split()[0]) == ("plan", "acme")
    assert (globex.hits[0].document_id, globex.hits[0].text.split()[0]) == ("plan", "globex")
    # The default tenant (no caller identity) has nothing here: to it the collection does not exist.
    with pytest.raises(errors.ValidationError, match="unknown collection 'shared'"):
        await service.search("shared", "secret roadmap", 10, SearchMode.SPARSE, {})


async def test_dense_and_hybrid_prefetches_are_scoped_too(dense_service: RetrieverService) -> None:
    await _ingest(dense_service)
    for mode in (SearchMode.DENSE, SearchMode.HYBRID):
        for metadata_filter in ESCAPES:
            hits = (
                await dense_service.search(
                    "shared", "globex merger", 50, mode, metadata_filter, tenant="acme"
                )
            ).hits
            assert hits == [] or all(h.metadata["owner"] == "acme" for h in hits), (mode, metadata_filter)
        own = (await dense_service.search("shared", "globex merger", 50, mode, {}, tenant="globex")).hits
        assert own[0].document_id == "only-globex"


async def test_writes_and_deletes_stay_within_the_tenant(
    service: RetrieverService, db: Database, index: QdrantEdgeIndex
) -> None:
    await _ingest(service)
    # Acme re-sends "plan" with new text: globex's "plan" is untouched.
    await service.upsert_documents(
        "shared", [DocumentIn(id="plan", text="acme revised launch date")], tenant="acme"
    )
    globex = await service.search("shared", "secret roadmap", 10, SearchMode.SPARSE, {}, tenant="globex")
    assert globex.hits[0].text.startswith("globex secret roadmap")
    # Acme deleting globex's ids removes nothing of globex's.
    assert await service.delete_documents("shared", ["only-globex"], tenant="acme") == 0
    assert await service.delete_documents("shared", ["plan"], tenant="acme") == 1
    globex = await service.search(
        "shared", "secret roadmap merger", 10, SearchMode.SPARSE, {}, tenant="globex"
    )
    assert {h.document_id for h in globex.hits} == {"plan", "only-globex"}
    async with db.session() as session:
        rows = (
            await session.execute(
                sa.select(DocumentRow.tenant, DocumentRow.id).order_by(DocumentRow.tenant, DocumentRow.id)
            )
        ).all()
    assert [tuple(r) for r in rows] == [("acme", "memo"), ("globex", "only-globex"), ("globex", "plan")]
    # The index agrees with the database: globex's "plan" chunk is still a point of its own.
    assert index.count("shared") == 3


async def test_collections_list_only_the_callers_documents(service: RetrieverService) -> None:
    await _ingest(service)
    await service.upsert_documents("acme-only", [DocumentIn(id="x", text="private")], tenant="acme")
    acme = {c.name: (c.document_count, c.chunk_count) for c in await service.list_collections(tenant="acme")}
    globex = {
        c.name: (c.document_count, c.chunk_count) for c in await service.list_collections(tenant="globex")
    }
    assert acme == {"acme-only": (1, 1), "shared": (2, 2)}
    assert globex == {"shared": (2, 2)}


async def test_rebuilt_index_keeps_the_tenants_apart(
    service: RetrieverService, db: Database, tmp_path: Path, settings: RetrieverSettings
) -> None:
    await _ingest(service)
    fresh = QdrantEdgeIndex(tmp_path / "fresh-index")
    try:
        rebuilt = RetrieverService(db, fresh, settings)
        assert await rebuilt.reconcile_index() == ["shared"]
        hits = (
            await rebuilt.search(
                "shared", "globex merger", 10, SearchMode.SPARSE, {"tenant": "acme"}, tenant="acme"
            )
        ).hits
        assert all(h.metadata["owner"] == "acme" for h in hits)
    finally:
        fresh.close()


@pytest.mark.parametrize("tenant", ["", " acme", "a/b", "x" * 129, "acme\n"])
async def test_malformed_tenant_is_refused(service: RetrieverService, tenant: str) -> None:
    with pytest.raises(errors.ValidationError) as caught:
        await service.upsert_documents("c", [DocumentIn(id="a", text="x")], tenant=tenant)
    assert caught.value.field == "tenant"


def test_caller_tenant_comes_from_identity() -> None:
    team = Principal(name="acme-token", role="team", team="acme")
    assert caller_tenant(None, ()) == DEFAULT_TENANT
    assert caller_tenant(SERVICE_PRINCIPAL, [(TENANT_METADATA_KEY, "globex")]) == "globex"
    assert caller_tenant(team, ()) == "acme"
    assert caller_tenant(team, [(TENANT_METADATA_KEY, "acme")]) == "acme"
    with pytest.raises(errors.PermissionDeniedError):
        caller_tenant(team, [(TENANT_METADATA_KEY, "globex")])
    with pytest.raises(errors.ValidationError):
        caller_tenant(SERVICE_PRINCIPAL, [(TENANT_METADATA_KEY, "acme"), (TENANT_METADATA_KEY, "globex")])


# --- over gRPC ------------------------------------------------------------------------------------


@pytest.fixture
async def server(service: RetrieverService) -> AsyncIterator[GrpcServer]:
    async with grpc_test_server(
        retrieval_pb2_grpc.add_RetrieverServiceServicer_to_server,
        RetrieverApi(service),
        "forge.retrieval.v1.RetrieverService",
        token=TOKEN,
        service="retriever",
    ) as started:
        yield started


@pytest.mark.integration
async def test_grpc_tenant_comes_from_the_call_metadata(server: GrpcServer) -> None:
    def docs(items: list[DocumentIn]) -> list[retrieval_pb2.Document]:
        return [
            retrieval_pb2.Document(id=d.id, title=d.title, text=d.text, metadata=dict(d.metadata))
            for d in items
        ]

    async with make_channel(f"127.0.0.1:{server.port}", token=TOKEN) as channel:
        stub = retrieval_pb2_grpc.RetrieverServiceStub(channel)
        as_acme = ((TENANT_METADATA_KEY, "acme"),)
        as_globex = ((TENANT_METADATA_KEY, "globex"),)
        await stub.UpsertDocuments(
            retrieval_pb2.UpsertDocumentsRequest(collection="shared", documents=docs(ACME)), metadata=as_acme
        )
        await stub.UpsertDocuments(
            retrieval_pb2.UpsertDocumentsRequest(collection="shared", documents=docs(GLOBEX)),
            metadata=as_globex,
        )
        for escape in ESCAPES:
            response = await stub.Search(
                retrieval_pb2.SearchRequest(
                    collection="shared",
                    query="globex merger solar",
                    top_k=50,
                    mode=retrieval_pb2.SEARCH_MODE_SPARSE,
                    filter=escape,
                ),
                metadata=as_acme,
            )
            assert all(c.metadata["owner"] == "acme" for c in response.chunks), escape
            assert response.chunks or escape, "acme's own chunks match the words"
        own = await stub.Search(
            retrieval_pb2.SearchRequest(collection="shared", query="merger", top_k=5), metadata=as_globex
        )
        assert [c.document_id for c in own.chunks] == ["only-globex"]
        listed = await stub.ListCollections(retrieval_pb2.ListCollectionsRequest(), metadata=as_acme)
        assert [(c.name, c.document_count) for c in listed.collections] == [("shared", 2)]
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Search(
                retrieval_pb2.SearchRequest(collection="shared", query="x"),
                metadata=((TENANT_METADATA_KEY, "bad tenant"),),
            )
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (FIELD_METADATA_KEY, TENANT_METADATA_KEY) in tuple(caught.value.trailing_metadata() or ())


# --- migration ------------------------------------------------------------------------------------


async def test_migration_moves_existing_documents_to_the_default_tenant(tmp_path: Path) -> None:
    await _migrate_populated_0001(Database(f"sqlite+aiosqlite:///{tmp_path / 'old.db'}"))


@pytest.mark.integration
async def test_migration_on_postgresql(postgres_url: str) -> None:
    await _migrate_populated_0001(Database(postgres_url))


async def _migrate_populated_0001(database: Database) -> None:

    def upgrade(to: str) -> None:
        def run(connection: Connection) -> None:
            config = Config()
            config.set_main_option("script_location", str(MIGRATIONS))
            config.attributes["connection"] = connection
            command.upgrade(config, to)

        return run  # type: ignore[return-value]

    try:
        async with database.engine.begin() as connection:
            await connection.run_sync(upgrade("0001"))  # type: ignore[arg-type]
            await connection.execute(sa.text("INSERT INTO collections VALUES ('c', 1, '2026-01-01')"))
            await connection.execute(
                sa.text(
                    "INSERT INTO documents VALUES ('c', 'a', 't', 'old text', '{}', 1, 'h', '2026-01-01', '2026-01-01')"
                )
            )
            await connection.execute(
                sa.text("INSERT INTO chunks VALUES (:p, 'c', 'a', 0, 'a#0', 'old text', 0, 8)"),
                {"p": point_id("c", "a", 0)},
            )
        await database.migrate(MIGRATIONS)
        async with database.session() as session:
            doc = (await session.scalars(sa.select(DocumentRow))).one()
            chunk = (await session.scalars(sa.select(ChunkRow))).one()
        assert (doc.tenant, doc.id, doc.text) == (DEFAULT_TENANT, "a", "old text")
        # The default tenant's point ids are the ids chunks had before tenants existed.
        assert (chunk.tenant, chunk.point_id) == (DEFAULT_TENANT, point_id("c", "a", 0, DEFAULT_TENANT))
    finally:
        await database.dispose()
