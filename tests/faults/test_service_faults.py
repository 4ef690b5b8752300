"""kill -9 of a data-owning leaf service under write load: what it acknowledged survives exactly
once, in its database, its index and on Kafka.

The retriever: writers upsert documents in batches while the process is killed and started
again in place; a batch that failed is re-sent (an upsert of the same content is a no-op, so a
retry never duplicates). Afterwards every document is counted in the collection, found in the
index, and announced once or more (at-least-once) by a ``DocumentChanged`` event on Kafka.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import grpc
import pytest
from aiokafka import AIOKafkaConsumer
from fault_platform import wait_ready
from forge.events.v1 import events_pb2
from forge.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc

from forge_kit.events import ensure_topics, topic_for
from forge_kit.grpckit import make_channel
from forge_kit.testing import ServiceProcess, TansuBroker, free_port

pytestmark = [pytest.mark.integration, pytest.mark.faults_full, pytest.mark.timeout(300)]
TOKEN = "faults-retriever-token"
DOCUMENTS = 240
BATCH = 8
WRITERS = 3
WORDS = [
    "granite",
    "harbour",
    "lantern",
    "meadow",
    "orchard",
    "pebble",
    "quarry",
    "saddle",
    "timber",
    "violet",
    "willow",
    "zephyr",
]


def document(n: int) -> retrieval_pb2.Document:
    """A document whose text is unique to it (so a search for its words finds it first)."""
    words = [WORDS[(n * 7 + i * 3) % len(WORDS)] for i in range(40)]
    return retrieval_pb2.Document(
        id=f"doc-{n:04d}", title=f"record {n}", text=f"marker{n:04d} " + " ".join(words)
    )


async def writer(target: str, batches: list[list[retrieval_pb2.Document]], acked: list[str]) -> int:
    """Upsert each batch until it is acknowledged; returns how many attempts failed."""
    failures = 0
    for batch in batches:
        while True:
            try:
                async with make_channel(target, token=TOKEN) as channel:
                    await retrieval_pb2_grpc.RetrieverServiceStub(channel).UpsertDocuments(
                        retrieval_pb2.UpsertDocumentsRequest(collection="faults", documents=batch), timeout=20
                    )
                acked.extend(d.id for d in batch)
                break
            except grpc.aio.AioRpcError as exc:
                assert exc.code() in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.CANCELLED,
                ), exc
                failures += 1
                await asyncio.sleep(0.2)
    return failures


async def events_for(bootstrap: str, collection: str, expect: int, timeout_s: float) -> dict[str, int]:
    """Distinct document ids (with counts) of the ``DocumentChanged`` events of ``collection``."""
    seen: dict[str, int] = {}
    consumer = AIOKafkaConsumer(
        topic_for(events_pb2.DocumentChanged()),
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        group_id=f"faults-{uuid.uuid4().hex[:6]}",
    )
    await consumer.start()
    try:
        deadline = time.monotonic() + timeout_s
        while len(seen) < expect and time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=500)
            for records in batches.values():
                for record in records:
                    event = events_pb2.DocumentChanged.FromString(record.value)
                    if event.collection == collection:
                        seen[event.document_id] = seen.get(event.document_id, 0) + 1
    finally:
        await consumer.stop()
    return seen


@pytest.mark.asyncio
async def test_retriever_kill_loses_no_document(tmp_path: Path) -> None:
    broker = TansuBroker(log_path=str(tmp_path / "tansu.log")).start()
    await ensure_topics(broker.bootstrap)
    retriever = ServiceProcess(
        "forge_retriever",
        env={
            "FORGE_RETRIEVER_GRPC_PORT": str(free_port()),
            "FORGE_RETRIEVER_HTTP_PORT": str(free_port()),
            "FORGE_RETRIEVER_DATA_DIR": str(tmp_path / "retriever"),
            "FORGE_RETRIEVER_KAFKA_BOOTSTRAP": broker.bootstrap,
            "FORGE_RETRIEVER_AUTH_TOKEN": TOKEN,
            "FORGE_RETRIEVER_DENSE_ENABLED": "false",  # BM25 only: the fault is the subject here
        },
        log_path=str(tmp_path / "retriever.log"),
    ).start()
    try:
        docs = [document(n) for n in range(DOCUMENTS)]
        batches = [docs[i : i + BATCH] for i in range(0, DOCUMENTS, BATCH)]
        acked: list[str] = []
        writers = [
            asyncio.create_task(writer(retriever.grpc_target, batches[w::WRITERS], acked))
            for w in range(WRITERS)
        ]
        # 1. Kill -9 once about a third is in, start again in place.
        while len(acked) < DOCUMENTS // 3:
            await asyncio.sleep(0.05)
        retriever.kill()
        killed = time.monotonic()
        await asyncio.to_thread(retriever.start)
        await asyncio.to_thread(wait_ready, retriever)
        recovery = time.monotonic() - killed
        failures = sum(await asyncio.gather(*writers))
        # 2. Count: the collection, the index, the events.
        async with make_channel(retriever.grpc_target, token=TOKEN) as channel:
            stub = retrieval_pb2_grpc.RetrieverServiceStub(channel)
            collections = await stub.ListCollections(retrieval_pb2.ListCollectionsRequest(), timeout=30)
            (collection,) = [c for c in collections.collections if c.name == "faults"]
            missing_in_index = []
            for doc in docs[::10]:
                hits = await stub.Search(
                    retrieval_pb2.SearchRequest(
                        collection="faults",
                        query=doc.text.split()[0],
                        top_k=3,
                        mode=retrieval_pb2.SEARCH_MODE_SPARSE,
                    ),
                    timeout=30,
                )
                if not hits.chunks or hits.chunks[0].document_id != doc.id:
                    missing_in_index.append(doc.id)
        announced = await events_for(broker.bootstrap, "faults", DOCUMENTS, timeout_s=60)
    finally:
        retriever.stop()
        broker.stop()
    print(
        f"\nfault retriever kill -9: recovered in {recovery:.1f}s; {failures} failed attempts retried; "
        f"{len(announced)} documents announced, {sum(announced.values()) - len(announced)} redeliveries"
    )
    assert sorted(acked) == sorted(d.id for d in docs)  # every batch acknowledged exactly once
    assert collection.document_count == DOCUMENTS, collection
    assert missing_in_index == []
    assert set(announced) == {d.id for d in docs}
    assert recovery <= 10
