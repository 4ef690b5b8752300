"""kill -9 of a data-owning leaf service under write load: what it acknowledged survives exactly
once, in its database, its index and on Kafka.

The preference service: raters answer through the JSON API while it is killed and started again;
a failed request is sent again unchanged (the service records a repeated answer once).

The retriever: writers upsert documents in batches while the process is killed and started
again in place; a batch that failed is re-sent (an upsert of the same content is a no-op, so a
retry never duplicates). Afterwards every document is counted in the collection, found in the
index, and announced once or more (at-least-once) by a ``DocumentChanged`` event on Kafka.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import grpc
import httpx
import pytest
from aiokafka import AIOKafkaConsumer
from fault_platform import wait_ready
from forge.events.v1 import events_pb2
from forge.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from google.protobuf.message import Message

from forge_kit.events import ensure_topics, topic_for
from forge_kit.grpckit import make_channel
from forge_kit.paths import data_dir
from forge_kit.testing import ServiceProcess, TansuBroker, base_env, free_port

pytestmark = [pytest.mark.integration, pytest.mark.faults_full, pytest.mark.timeout(300)]
TOKEN = "faults-retriever-token"
DATA = data_dir()
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


async def announced(
    bootstrap: str, kind: type[Message], key: Callable[[Message], str | None], expect: int, timeout_s: float
) -> dict[str, int]:
    """How often each id ``key`` picks out of the ``kind`` events on the broker was announced,
    read from the start of the topic until ``expect`` distinct ids are seen (or ``timeout_s``);
    ``key`` returns None for events of other tests."""
    seen: dict[str, int] = {}
    consumer = AIOKafkaConsumer(
        topic_for(kind()),
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        group_id=f"faults-{uuid.uuid4().hex[:6]}",
    )
    await consumer.start()
    try:
        deadline = time.monotonic() + timeout_s
        while len(seen) < expect and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                for record in records:
                    found = key(kind.FromString(record.value))
                    if found is not None:
                        seen[found] = seen.get(found, 0) + 1
    finally:
        await consumer.stop()
    return seen


@pytest.mark.asyncio
async def test_retriever_kill_loses_no_document(tmp_path: Path) -> None:
    broker = TansuBroker(log_path=str(tmp_path / "tansu.log")).start()
    await ensure_topics(broker.bootstrap)
    retriever = ServiceProcess(
        "forge_retriever",
        env=base_env(
            "retriever",
            token=TOKEN,
            data_dir=tmp_path / "retriever",
            kafka=broker.bootstrap,
            grpc_port=free_port(),
            http_port=free_port(),
            dense_enabled="false",  # BM25 only: the fault is the subject here
        ),
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
        announced_docs = await announced(
            broker.bootstrap,
            events_pb2.DocumentChanged,
            lambda e: e.document_id if e.collection == "faults" else None,  # type: ignore[attr-defined]
            DOCUMENTS,
            timeout_s=60,
        )
    finally:
        retriever.stop()
        broker.stop()
    print(
        f"\nfault retriever kill -9: recovered in {recovery:.1f}s; {failures} failed attempts retried; "
        f"{len(announced_docs)} documents announced, {sum(announced_docs.values()) - len(announced_docs)} redeliveries"
    )
    assert sorted(acked) == sorted(d.id for d in docs)  # every batch acknowledged exactly once
    assert collection.document_count == DOCUMENTS, collection
    assert missing_in_index == []
    assert set(announced_docs) == {d.id for d in docs}
    assert recovery <= 10


FEEDBACK_RATERS = 3
FEEDBACK_PASSWORD = "faults-rater-password"


async def rate_until_done(http: httpx.AsyncClient, rater: str, acked: dict[tuple[str, str], str]) -> int:
    """Log in, then take comparisons and answer them until none is left; a request that fails
    (the service is down) is sent again unchanged. Returns the number of failed attempts."""
    failures = 0

    async def call(method: str, path: str, **kwargs: object) -> httpx.Response:
        nonlocal failures
        while True:
            try:
                reply = await http.request(method, path, **kwargs)  # type: ignore[arg-type]
            except httpx.TransportError:
                failures += 1
                await asyncio.sleep(0.2)
                continue
            if reply.status_code >= 500:
                failures += 1
                await asyncio.sleep(0.2)
                continue
            assert reply.status_code == 200, (path, reply.status_code, reply.text)
            return reply

    login = await call("POST", "/api/v1/sessions", json={"rater_id": rater, "password": FEEDBACK_PASSWORD})
    headers = {"Authorization": f"Bearer {login.json()['token']}"}
    for n in range(10_000):
        item = (await call("GET", "/api/v1/comparisons/next", headers=headers)).json()["comparison"]
        if item is None:
            return failures
        choice = ("A", "B", "TIE")[n % 3]
        body = {"comparison_id": item["id"], "choice": choice}
        recorded = await call("POST", "/api/v1/preferences", headers=headers, json=body)
        acked[(rater, item["id"])] = recorded.json()["preference_id"]
    raise AssertionError("the queue never ran dry")


@pytest.mark.asyncio
async def test_preference_feedback_kill_loses_no_preference(tmp_path: Path) -> None:
    """Raters answer through the JSON API while the service is killed -9 and started again;
    every acknowledged preference is in the database once and on Kafka."""
    data = tmp_path / "feedback"
    for r in range(FEEDBACK_RATERS):
        subprocess.run(
            [
                str(Path(sys.executable).with_name("forge")),
                "feedback",
                "add-rater",
                f"rater{r}",
                "--data-dir",
                str(data),
            ],
            env={**os.environ, "FORGE_FEEDBACK_PASSWORD": FEEDBACK_PASSWORD},
            check=True,
            capture_output=True,
            timeout=120,
        )
    broker = TansuBroker(log_path=str(tmp_path / "tansu.log")).start()
    await ensure_topics(broker.bootstrap)
    env = base_env(
        "preference_feedback",
        token=TOKEN,
        data_dir=data,
        kafka=broker.bootstrap,
        grpc_port=free_port(),
        http_port=free_port(),
        seed_dir=str(DATA / "preferences" / "hh-rlhf"),
        seed_limit="40",
        overlap_k=str(FEEDBACK_RATERS),
    )
    service = ServiceProcess(
        "forge_preference_feedback", env=env, log_path=str(tmp_path / "feedback.log")
    ).start()
    try:
        acked: dict[tuple[str, str], str] = {}
        async with httpx.AsyncClient(base_url=service.http_url, timeout=20) as http:
            raters = [
                asyncio.create_task(rate_until_done(http, f"rater{r}", acked)) for r in range(FEEDBACK_RATERS)
            ]
            while len(acked) < 30:
                await asyncio.sleep(0.05)
            service.kill()
            killed = time.monotonic()
            await asyncio.to_thread(service.start)
            await asyncio.to_thread(wait_ready, service)
            recovery = time.monotonic() - killed
            failures = sum(await asyncio.gather(*raters))
        with sqlite3.connect(data / "preference_feedback.db") as conn:
            rows = [str(r[0]) for r in conn.execute("SELECT id FROM feedback_preferences")]
        announced_prefs = await announced(
            broker.bootstrap,
            events_pb2.PreferenceRecorded,
            lambda e: e.preference_id,  # type: ignore[attr-defined]
            len(rows),
            timeout_s=60,
        )
    finally:
        service.stop()
        broker.stop()
    print(
        f"\nfault preference_feedback kill -9: recovered in {recovery:.1f}s; {failures} failed requests retried; "
        f"{len(acked)} preferences acknowledged, {len(rows)} rows, {len(announced_prefs)} on Kafka"
    )
    assert len(acked) == 40 * FEEDBACK_RATERS  # every comparison answered by every rater
    assert sorted(rows) == sorted(acked.values())  # each acknowledged preference once, nothing else
    assert set(announced_prefs) == set(rows)
    assert recovery <= 10
