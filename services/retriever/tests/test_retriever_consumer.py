"""Document changes arriving through the document-change topic.

The handler tests drive the kit's ``EventConsumer.handle`` with records built here (no network);
the last test runs the consumer against the real Tansu broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import sqlalchemy as sa
from aiokafka import ConsumerRecord
from forge.events.v1 import events_pb2

from forge_kit import errors
from forge_kit.consumer import EventConsumer
from forge_kit.db import Database
from forge_kit.events import DeadLetter, KafkaPublisher, OutboxEvent, ensure_topics, new_meta, topic_for
from forge_kit.testing import eventkeys
from forge_kit.testing.processes import TansuBroker
from forge_retriever.api import document_change_handler
from forge_retriever.documents import ChangeOutcome, DocumentIn, SearchMode
from forge_retriever.messages import document_change
from forge_retriever.service import RetrieverService
from forge_retriever.store import DocumentRow
from forge_retriever.tenancy import DEFAULT_TENANT

TOPIC = topic_for(events_pb2.DocumentChanged())
UPSERTED, DELETED = events_pb2.DOCUMENT_CHANGE_TYPE_UPSERTED, events_pb2.DOCUMENT_CHANGE_TYPE_DELETED


def change(
    document_id: str,
    text: str = "",
    *,
    version: int = 0,
    kind: int = UPSERTED,
    collection: str = "wiki",
    producer: str = "cms",
    tenant: str = "",
) -> events_pb2.DocumentChanged:
    return events_pb2.DocumentChanged(
        meta=new_meta(producer),
        collection=collection,
        tenant=tenant,
        document_id=document_id,
        change=kind,  # type: ignore[arg-type]
        version=version,
        text=text,
        metadata={"source": producer} if kind == UPSERTED else {},
    )


def record(event: events_pb2.DocumentChanged, offset: int = 0) -> ConsumerRecord:  # type: ignore[type-arg]
    headers = eventkeys.headers_for(event)
    return ConsumerRecord(
        topic=TOPIC,
        partition=0,
        offset=offset,
        timestamp=0,
        timestamp_type=0,
        key=None,
        value=event.SerializeToString(),
        checksum=None,
        serialized_key_size=0,
        serialized_value_size=0,
        headers=headers,
    )


def consumer(db: Database, service: RetrieverService, bootstrap: str = "unused:0") -> EventConsumer:
    return EventConsumer(
        db,
        bootstrap=bootstrap,
        group_id="retriever",
        topics=[TOPIC],
        handler=document_change_handler(service),
        verifier=eventkeys.verifier([*eventkeys.PRODUCERS, "cms"]),
        sources={TOPIC: ["cms"]},
        max_attempts=1,
        session_timeout_ms=6_000,
    )


async def found(
    service: RetrieverService, query: str, collection: str = "wiki", tenant: str | None = None
) -> list[tuple[str, str]]:
    """The hits of a search; none where the tenant holds no document of the collection (then the
    collection does not exist for it, and the search says so as for any missing collection)."""
    try:
        result = await (
            service.search(collection, query, 10, SearchMode.SPARSE, {})
            if tenant is None
            else service.search(collection, query, 10, SearchMode.SPARSE, {}, tenant=tenant)
        )
    except errors.ValidationError as exc:
        assert f"unknown collection {collection!r}" in str(exc)
        return []
    return [(h.document_id, h.text) for h in result.hits]


async def apply(db: Database, service: RetrieverService, event: events_pb2.DocumentChanged) -> ChangeOutcome:
    async with db.session() as session:
        return await service.apply_document_change(document_change(event), session)


async def test_upsert_and_delete_from_the_topic_are_searchable_and_not_republished(
    service: RetrieverService, db: Database
) -> None:
    c = consumer(db, service)
    assert await c.handle(record(change("alpha", "giraffes graze the savanna", version=1)))
    assert await found(service, "giraffes") == [("alpha", "giraffes graze the savanna")]
    assert await c.handle(record(change("alpha", "zebras graze the savanna", version=2)))
    assert await found(service, "giraffes") == [] and [d for d, _ in await found(service, "zebras")] == [
        "alpha"
    ]
    assert await c.handle(record(change("alpha", kind=DELETED, version=3)))
    assert await found(service, "zebras") == []
    # The topic already carries these changes: the retriever's outbox stays empty.
    async with db.session() as session:
        assert await session.scalar(sa.select(sa.func.count()).select_from(OutboxEvent)) == 0


async def test_redelivered_and_stale_events_change_nothing(service: RetrieverService, db: Database) -> None:
    c = consumer(db, service)
    v2 = change("alpha", "version two text", version=2)
    assert await c.handle(record(v2))
    assert await c.handle(record(v2)) is False  # same event id: a duplicate
    # An older version delivered late (another partition, a replay) does not roll back.
    assert await apply(db, service, change("alpha", "version one text", version=1)) is ChangeOutcome.STALE
    assert [t for _, t in await found(service, "version text")] == ["version two text"]
    # Nor can a late upsert resurrect a document deleted at a newer version.
    assert await apply(db, service, change("alpha", kind=DELETED, version=3)) is ChangeOutcome.APPLIED
    assert await apply(db, service, change("alpha", "version two text", version=2)) is ChangeOutcome.STALE
    assert await found(service, "version text") == []
    # Re-sending held content, or deleting an absent document, is a no-op.
    assert await apply(db, service, change("beta", "same words", version=1)) is ChangeOutcome.APPLIED
    assert await apply(db, service, change("beta", "same words", version=2)) is ChangeOutcome.UNCHANGED
    assert await apply(db, service, change("gamma", kind=DELETED, version=1)) is ChangeOutcome.UNCHANGED
    # Unversioned events (version 0) are applied in arrival order.
    assert await apply(db, service, change("beta", "other words")) is ChangeOutcome.APPLIED
    assert [t for _, t in await found(service, "words")] == ["other words"]
    # ... and never lower the mark a versioned event set (beta is at version 2).
    assert await apply(db, service, change("beta", "stale words", version=1)) is ChangeOutcome.STALE


async def test_own_events_are_skipped(service: RetrieverService, db: Database) -> None:
    own = change("alpha", "written through grpc already", version=9, producer="retriever")
    assert await apply(db, service, own) is ChangeOutcome.OWN
    assert await service.list_collections() == []


async def test_upstream_documents_belong_to_the_source_tenant(
    service: RetrieverService, db: Database
) -> None:
    await apply(db, service, change("alpha", "shared handbook", version=1))
    assert [d for d, _ in await found(service, "handbook")] == ["alpha"]
    assert await found(service, "handbook", tenant="acme") == []
    async with db.session() as session:
        tenants = set(await session.scalars(sa.select(DocumentRow.tenant)))
    assert tenants == {DEFAULT_TENANT}


async def test_an_event_naming_a_tenant_writes_only_into_that_tenant(
    service: RetrieverService, db: Database
) -> None:
    await apply(db, service, change("alpha", "acme quarterly plan", version=1, tenant="acme"))
    await apply(db, service, change("alpha", "globex quarterly plan", version=1, tenant="globex"))
    acme = await service.search("wiki", "quarterly plan", 10, SearchMode.SPARSE, {}, tenant="acme")
    assert [h.text for h in acme.hits] == ["acme quarterly plan"]
    assert await found(service, "quarterly plan") == []  # the source tenant sees neither
    # A delete names its tenant too: globex's copy goes, acme's stays.
    await apply(db, service, change("alpha", kind=DELETED, version=2, tenant="globex"))
    assert await found(service, "quarterly plan", tenant="globex") == []
    assert [t for _, t in await found(service, "quarterly plan", tenant="acme")] == ["acme quarterly plan"]


async def test_own_events_name_the_writing_tenant(service: RetrieverService, db: Database) -> None:
    await service.upsert_documents("wiki", [DocumentIn("alpha", "tenant scoped text")], tenant="acme")
    await service.delete_documents("wiki", ["alpha"], tenant="acme")
    async with db.session() as session:
        rows = (await session.scalars(sa.select(OutboxEvent))).all()
    assert len(rows) == 2
    for row in rows:
        event = events_pb2.DocumentChanged.FromString(row.payload)
        assert event.tenant == "acme"


@pytest.mark.parametrize(
    ("event", "field"),
    [
        (change("alpha", "text", collection="../etc"), "collection"),
        (change("", "text"), "document_id"),
        (change("alpha", "   "), "document.text"),
        (change("alpha", "text", kind=0), "change"),
        (change("alpha", "text", tenant="no spaces allowed"), "tenant"),
    ],
)
async def test_bad_events_are_refused_and_dead_lettered(
    service: RetrieverService, db: Database, event: events_pb2.DocumentChanged, field: str
) -> None:
    with pytest.raises(errors.ValidationError) as caught:
        await apply(db, service, event)
    assert caught.value.field == field
    assert await consumer(db, service).handle(record(event)) is False
    async with db.session() as session:
        letters = (await session.scalars(sa.select(DeadLetter))).all()
    assert len(letters) == 1 and field in letters[0].error
    assert await service.list_collections() == []


@pytest.mark.integration
async def test_changes_published_to_the_broker_are_applied_by_the_live_consumer(
    kafka_broker: TansuBroker, service: RetrieverService, db: Database
) -> None:
    await ensure_topics(kafka_broker.bootstrap, [TOPIC])
    c = consumer(db, service, kafka_broker.bootstrap)
    await c.start()
    task = asyncio.create_task(c.run())
    publisher = KafkaPublisher(kafka_broker.bootstrap, signer=eventkeys.signer("cms"))
    try:
        await publisher.publish(change("alpha", "okapis live in the forest", version=1), key="wiki/alpha")
        started = time.monotonic()
        while not await _listed(service):
            assert time.monotonic() - started < 30, "the consumer never applied the first event"
            await asyncio.sleep(0.05)
        assert [d for d, _ in await found(service, "okapis")] == ["alpha"]
        # The group is live now: a later change shows up too. (The 2 s freshness target is measured
        # by load/retrieval/bench_freshness.py, not timed here on a shared test machine.)
        await publisher.publish(change("alpha", kind=DELETED, version=2), key="wiki/alpha")
        sent = time.monotonic()
        while await found(service, "okapis"):
            assert time.monotonic() - sent < 30, "the consumer never applied the delete"
            await asyncio.sleep(0.02)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await c.stop()
        await publisher.close()


async def _listed(service: RetrieverService) -> bool:
    return any(c.name == "wiki" and c.document_count for c in await service.list_collections())
