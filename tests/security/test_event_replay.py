"""Issue 36, hole 4: a replayed old genuine event must not roll a consumer's state back.

Signatures carry no expiry, so an old signed event is as valid as a new one; each consumer
group's deduplication on the event id is all that stops a replay, and a group whose record is
gone (a new group, a wiped or pruned dedupe table) applies it again. The retriever's
per-document mark now holds the newest applied change's signed event time too, so an
unversioned ``DocumentChanged`` older than what was applied is ignored (versioned ones were
already ordered by version).

The attack, on a real retriever and broker: the trusted source ``cms`` upserts a document, then
deletes it; the attacker, who read both signed records off the broker, publishes the old upsert
again, unchanged, to a retriever whose dedupe record of it is gone. The document stays deleted.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from aiokafka import AIOKafkaProducer
from forge.events.v1 import events_pb2
from forge.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc

from forge_kit.events import ensure_topics, new_meta, topic_for
from forge_kit.grpckit import make_channel
from forge_kit.testing import ServiceProcess, TansuBroker, base_env, eventkeys

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

TOKEN = "replay-retriever-token"
DOCS = topic_for(events_pb2.DocumentChanged())


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[TansuBroker]:
    started = TansuBroker(log_path=str(tmp_path / "broker.log")).start()
    asyncio.run(ensure_topics(started.bootstrap, [DOCS]))
    yield started
    started.stop()


def retriever(tmp_path: Path, broker: TansuBroker) -> ServiceProcess:
    return ServiceProcess(
        "forge_retriever",
        env=base_env(
            "retriever",
            token=TOKEN,
            data_dir=tmp_path / "retriever",
            kafka=broker.bootstrap,
            extra_producers=["cms"],
            dense_enabled="false",
            document_sources='["cms"]',
        ),
        log_path=str(tmp_path / "retriever.log"),
    )


def change(doc_id: str, text: str, kind: int) -> tuple[bytes, list[tuple[str, bytes]]]:
    """A genuine unversioned change signed by the trusted source, as published."""
    event = events_pb2.DocumentChanged(
        meta=new_meta("cms"),
        collection="wiki",
        tenant="t",
        document_id=doc_id,
        change=kind,
        title=doc_id,
        text=text,
    )
    payload = event.SerializeToString()
    headers = eventkeys.signer("cms").headers(
        topic=DOCS, event_type=event.DESCRIPTOR.full_name, event_id=event.meta.event_id, payload=payload
    )
    return payload, headers


async def publish(bootstrap: str, records: list[tuple[bytes, list[tuple[str, bytes]]]]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for value, headers in records:
            await producer.send_and_wait(DOCS, value, key=b"doc", headers=headers)
    finally:
        await producer.stop()


async def found(target: str, word: str) -> list[str]:
    async with make_channel(target, token=TOKEN) as channel:
        stub = retrieval_pb2_grpc.RetrieverServiceStub(channel)
        try:
            reply = await stub.Search(
                retrieval_pb2.SearchRequest(
                    collection="wiki", query=word, top_k=5, mode=retrieval_pb2.SEARCH_MODE_SPARSE
                ),
                metadata=(("forge-tenant", "t"),),
                timeout=5,
            )
        except grpc.aio.AioRpcError:
            return []
    return [c.document_id for c in reply.chunks]


def wait_until(check: object, what: str, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_a_replayed_old_upsert_does_not_resurrect_a_deleted_document(
    broker: TansuBroker, tmp_path: Path
) -> None:
    word, marker = f"secret{uuid.uuid4().hex[:10]}", f"later{uuid.uuid4().hex[:10]}"
    upsert = change(
        "leaked", f"This page mentions {word} among other words.", events_pb2.DOCUMENT_CHANGE_TYPE_UPSERTED
    )
    time.sleep(0.01)  # the delete happens after the upsert, by the events' own clock
    delete = change("leaked", "", events_pb2.DOCUMENT_CHANGE_TYPE_DELETED)
    service = retriever(tmp_path, broker).start(120)
    try:
        asyncio.run(publish(broker.bootstrap, [upsert]))
        wait_until(
            lambda: asyncio.run(found(service.grpc_target, word)) == ["leaked"],
            "the upsert was never applied",
        )
        asyncio.run(publish(broker.bootstrap, [delete]))
        wait_until(
            lambda: asyncio.run(found(service.grpc_target, word)) == [], "the delete was never applied"
        )
    finally:
        service.stop()
    # The retriever's record of what it consumed is gone (a new or wiped consumer group).
    with sqlite3.connect(tmp_path / "retriever" / "retriever.db") as db:
        assert db.execute("DELETE FROM forge_processed_events").rowcount >= 2

    service = retriever(tmp_path, broker).start(120)
    try:
        # The attacker replays the old genuine upsert, byte for byte, then a fresh document comes.
        later = change("later", f"This page mentions {marker}.", events_pb2.DOCUMENT_CHANGE_TYPE_UPSERTED)
        asyncio.run(publish(broker.bootstrap, [upsert, later]))
        wait_until(
            lambda: asyncio.run(found(service.grpc_target, marker)) == ["later"],
            "the later document never came",
        )
        assert asyncio.run(found(service.grpc_target, word)) == [], (
            "the replayed upsert resurrected the document"
        )
    finally:
        service.stop()
