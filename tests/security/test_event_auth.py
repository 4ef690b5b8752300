"""Issue 22, hole 3: events are trusted from anyone who can reach the broker.

The attacker here has no credentials at all, only the broker's address: it publishes records with
aiokafka straight to the topics the retriever and the gateway consume — unsigned, signed with a
key nobody knows, signed with another producer's (real) key, a legitimate event replayed with an
altered payload — and, on the catch-up path, serves forged outbox rows from its own
EventLogService. None may be applied; each is counted in ``forge_events_rejected_total``; a
properly signed event on the same partition, behind them, is applied.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from aiokafka import AIOKafkaProducer
from forge.common.v1 import common_pb2
from forge.events.v1 import events_pb2, events_pb2_grpc
from forge.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from google.protobuf.message import Message
from sqlalchemy.ext.asyncio import AsyncSession

from forge_kit.consumer import EventConsumer
from forge_kit.db import Database
from forge_kit.eventauth import HEADER_SIGNATURE, EventSigner
from forge_kit.eventlog import CatchUp, CatchUpSource
from forge_kit.events import HEADER_ID, HEADER_PRODUCER, HEADER_TYPE, ensure_topics, new_meta, topic_for
from forge_kit.grpckit import make_channel, serve
from forge_kit.testing import ServiceProcess, TansuBroker, base_env, eventkeys, free_port

pytestmark = pytest.mark.integration

RETRIEVER_TOKEN = "retriever-sec-token"
GATEWAY_TOKEN = "gateway-sec-token"
DOCS = topic_for(events_pb2.DocumentChanged())
PROMOTIONS = topic_for(events_pb2.ModelPromoted())
PARTITION_KEY = b"same-partition"  # every record on one partition: the signed one comes last


def _doc(doc_id: str, word: str, *, producer: str, tenant: str = "victim") -> events_pb2.DocumentChanged:
    return events_pb2.DocumentChanged(
        meta=new_meta(producer),
        collection="wiki",
        tenant=tenant,
        document_id=doc_id,
        change=events_pb2.DOCUMENT_CHANGE_TYPE_UPSERTED,
        version=1,
        title=doc_id,
        text=f"This page mentions {word} among ordinary words.",
    )


def _plain_headers(event: Message) -> list[tuple[str, bytes]]:
    """What the platform sent before events were signed: type, id, producer."""
    meta = event.meta  # type: ignore[attr-defined]
    return [
        (HEADER_TYPE, event.DESCRIPTOR.full_name.encode()),
        (HEADER_ID, meta.event_id.encode()),
        (HEADER_PRODUCER, meta.producer.encode()),
    ]


def _signed(event: Message, signer: EventSigner, topic: str) -> list[tuple[str, bytes]]:
    meta = event.meta  # type: ignore[attr-defined]
    return signer.headers(
        topic=topic,
        event_type=event.DESCRIPTOR.full_name,
        event_id=meta.event_id,
        payload=event.SerializeToString(),
    )


async def _raw_publish(
    bootstrap: str, topic: str, records: list[tuple[bytes, list[tuple[str, bytes]]]]
) -> None:
    """Publish as the attacker does: a bare aiokafka producer, no Forge code, no credentials."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for value, headers in records:
            await producer.send_and_wait(topic, value, key=PARTITION_KEY, headers=headers)
    finally:
        await producer.stop()


def _rejected(metrics_text: str, reason: str) -> float:
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("forge_events_rejected_total{") and f'reason="{reason}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[TansuBroker]:
    started = TansuBroker(log_path=str(tmp_path / "broker.log")).start()
    asyncio.run(ensure_topics(started.bootstrap, [DOCS, PROMOTIONS]))
    yield started
    started.stop()


def _forged_documents(
    attacker_word: str,
) -> tuple[list[tuple[bytes, list[tuple[str, bytes]]]], dict[str, int]]:
    """Every forgery of a DocumentChanged for tenant ``victim``, and the rejection reasons expected."""
    cms = eventkeys.signer("cms")
    records: list[tuple[bytes, list[tuple[str, bytes]]]] = []
    # 1. Unsigned, as anyone could publish before the fix.
    unsigned = _doc("forged-unsigned", attacker_word, producer="cms")
    records.append((unsigned.SerializeToString(), _plain_headers(unsigned)))
    # 2. Signed with a key of the attacker's own, claiming to be the trusted source.
    stranger = EventSigner.generate("cms")
    own_key = _doc("forged-own-key", attacker_word, producer="cms")
    records.append((own_key.SerializeToString(), _signed(own_key, stranger, DOCS)))
    # 3. Signed with another producer's real key (eval may sign eval's events, not documents).
    other = _doc("forged-by-eval", attacker_word, producer="eval")
    records.append((other.SerializeToString(), _signed(other, eventkeys.signer("eval"), DOCS)))
    # 4. Eval's real key and signature, but the headers claim the trusted source.
    claimed = _doc("forged-claimed", attacker_word, producer="cms")
    headers = [
        (k, b"cms" if k == HEADER_PRODUCER else v)
        for k, v in _signed(claimed, eventkeys.signer("eval"), DOCS)
    ]
    records.append((claimed.SerializeToString(), headers))
    # 5. A genuine signed event replayed with its payload altered (and a fresh id, so no dedupe).
    genuine = _doc("replayed", "harmless", producer="cms", tenant="cms-tenant")
    genuine_headers = _signed(genuine, cms, DOCS)
    altered = events_pb2.DocumentChanged()
    altered.CopyFrom(genuine)
    altered.tenant, altered.text = "victim", f"This page mentions {attacker_word} now."
    records.append((altered.SerializeToString(), genuine_headers))
    # 6. A valid signature over other bytes (garbage in the signature header).
    mangled = _doc("forged-mangled", attacker_word, producer="cms")
    mangled_headers = [
        (k, b"!!not-base64!!" if k == HEADER_SIGNATURE else v) for k, v in _signed(mangled, cms, DOCS)
    ]
    records.append((mangled.SerializeToString(), mangled_headers))
    expected = {"unsigned": 1, "unknown_key": 1, "wrong_producer": 2, "bad_signature": 1, "malformed": 1}
    return records, expected


async def _search(target: str, word: str, tenant: str) -> list[str]:
    async with make_channel(target, token=RETRIEVER_TOKEN) as channel:
        stub = retrieval_pb2_grpc.RetrieverServiceStub(channel)
        try:
            reply = await stub.Search(
                retrieval_pb2.SearchRequest(
                    collection="wiki", query=word, top_k=10, mode=retrieval_pb2.SEARCH_MODE_SPARSE
                ),
                metadata=(("forge-tenant", tenant),),
                timeout=5,
            )
        except grpc.aio.AioRpcError:
            return []  # the collection does not exist yet
    return [c.document_id for c in reply.chunks]


def test_forged_document_changes_never_reach_another_tenants_index(
    broker: TansuBroker, tmp_path: Path
) -> None:
    retriever = ServiceProcess(
        "forge_retriever",
        env=base_env(
            "retriever",
            token=RETRIEVER_TOKEN,
            data_dir=tmp_path / "retriever",
            kafka=broker.bootstrap,
            extra_producers=["cms"],
            dense_enabled="false",
            document_sources='["cms"]',
        ),
        log_path=str(tmp_path / "retriever.log"),
    ).start(120)
    try:
        attacker_word = f"evil{uuid.uuid4().hex[:10]}"
        records, expected = _forged_documents(attacker_word)
        good_word = f"fine{uuid.uuid4().hex[:10]}"
        good = _doc("legit", good_word, producer="cms")
        records.append((good.SerializeToString(), _signed(good, eventkeys.signer("cms"), DOCS)))
        asyncio.run(_raw_publish(broker.bootstrap, DOCS, records))

        deadline = time.monotonic() + 60
        while not asyncio.run(_search(retriever.grpc_target, good_word, "victim")):
            assert time.monotonic() < deadline, "the signed event from the trusted source was never applied"
            time.sleep(0.2)
        # The signed one came last on the partition: every forgery before it has been handled.
        assert asyncio.run(_search(retriever.grpc_target, attacker_word, "victim")) == []
        assert asyncio.run(_search(retriever.grpc_target, "harmless", "cms-tenant")) == []
        metrics = httpx.get(f"{retriever.http_url}/metrics", timeout=30).text
        for reason, count in expected.items():
            assert _rejected(metrics, reason) == count, (reason, metrics)
        assert "event.rejected" in Path(tmp_path / "retriever.log").read_text()
    finally:
        retriever.stop()


def test_forged_model_promotions_do_not_move_production(broker: TansuBroker, tmp_path: Path) -> None:
    gateway = ServiceProcess(
        "forge_inference_gateway",
        env=base_env(
            "inference_gateway",
            token=GATEWAY_TOKEN,
            data_dir=tmp_path / "gateway",
            kafka=broker.bootstrap,
            model_server_url=f"http://127.0.0.1:{free_port()}",
        ),
        cwd=str(tmp_path),
        log_path=str(tmp_path / "gateway.log"),
    ).start(60)

    def promotion(name: str, producer: str = "eval") -> events_pb2.ModelPromoted:
        return events_pb2.ModelPromoted(
            meta=new_meta(producer),
            model=common_pb2.ModelRef(name=name),
            stage="production",
            traffic_percent=100,
            reason="gate passed",
        )

    try:
        unsigned = promotion("attacker-unsigned")
        by_retriever = promotion("attacker-retriever", producer="retriever")
        claimed = promotion("attacker-claimed", producer="eval")
        claimed_headers = [
            (k, b"eval" if k == HEADER_PRODUCER else v)
            for k, v in _signed(claimed, eventkeys.signer("retriever"), PROMOTIONS)
        ]
        legit = promotion("tiny")
        legit_headers = _signed(legit, eventkeys.signer("eval"), PROMOTIONS)
        altered = promotion("attacker-altered")
        altered.meta.CopyFrom(legit.meta)
        records = [
            (unsigned.SerializeToString(), _plain_headers(unsigned)),
            (
                by_retriever.SerializeToString(),
                _signed(by_retriever, eventkeys.signer("retriever"), PROMOTIONS),
            ),
            (claimed.SerializeToString(), claimed_headers),
            (altered.SerializeToString(), legit_headers),  # the genuine headers on altered bytes
            (legit.SerializeToString(), legit_headers),
        ]
        asyncio.run(_raw_publish(broker.bootstrap, PROMOTIONS, records))
        admin = {"Authorization": f"Bearer {GATEWAY_TOKEN}"}
        deadline = time.monotonic() + 60
        aliases: dict[str, object] = {}
        with httpx.Client(base_url=gateway.http_url, timeout=30) as client:
            while "production" not in aliases:
                assert time.monotonic() < deadline, "the signed promotion was never applied"
                listed = client.get("/admin/v1/aliases", headers=admin).json()["aliases"]
                aliases = {a["alias"]: a["model"] for a in listed}
                time.sleep(0.2)
            assert aliases["production"] == {"name": "tiny", "version": ""}
            assert not any("attacker" in json.dumps(model) for model in aliases.values())
            metrics = client.get("/metrics").text
        assert _rejected(metrics, "unsigned") == 1
        assert _rejected(metrics, "wrong_producer") == 2
        assert _rejected(metrics, "bad_signature") == 1
    finally:
        gateway.stop()


# --- the catch-up path --------------------------------------------------------------------------


class _ForgingEventLog(events_pb2_grpc.EventLogServiceServicer):
    """An EventLogService answering with forged JobStateChanged rows (a spoofed or hijacked
    catch-up source)."""

    def __init__(self, records: list[events_pb2.EventRecord]) -> None:
        self._records = records

    async def ListEvents(
        self, request: events_pb2.ListEventsRequest, context: grpc.aio.ServicerContext
    ) -> events_pb2.ListEventsResponse:
        rows = [r for r in self._records if r.sequence > request.after_sequence]
        return events_pb2.ListEventsResponse(
            events=rows, last_sequence=rows[-1].sequence if rows else request.after_sequence, has_more=False
        )


async def test_catch_up_applies_no_forged_outbox_row(db: Database) -> None:
    topic = topic_for(events_pb2.JobStateChanged())

    def job(sequence: int, job_id: str, producer: str = "scheduler") -> events_pb2.EventRecord:
        event = events_pb2.JobStateChanged(meta=new_meta(producer), job_id=job_id, team="victims")
        return events_pb2.EventRecord(
            sequence=sequence,
            event_id=event.meta.event_id,
            topic=topic,
            event_type=event.DESCRIPTOR.full_name,
            payload=event.SerializeToString(),
        )

    def sign(record: events_pb2.EventRecord, signer: EventSigner) -> events_pb2.EventRecord:
        record.producer, record.key_id = signer.producer, signer.key_id
        record.signature = signer.sign(
            topic=record.topic, event_type=record.event_type, event_id=record.event_id, payload=record.payload
        )
        return record

    unsigned = job(1, "forged-unsigned")
    stranger = sign(job(2, "forged-stranger"), EventSigner.generate("scheduler"))
    by_eval = sign(job(3, "forged-eval", producer="eval"), eventkeys.signer("eval"))
    altered = sign(job(4, "altered"), eventkeys.signer("scheduler"))
    altered.payload = events_pb2.JobStateChanged(
        meta=events_pb2.EventMeta(event_id=altered.event_id, producer="scheduler"), job_id="forged-altered"
    ).SerializeToString()
    good = sign(job(5, "genuine"), eventkeys.signer("scheduler"))
    server = await serve(
        service="forger",
        register=[
            lambda s: events_pb2_grpc.add_EventLogServiceServicer_to_server(
                _ForgingEventLog([unsigned, stranger, by_eval, altered, good]), s
            )
        ],
        service_names=[],
        host="127.0.0.1",
        port=0,
        token="forger-token",
        default_deadline_s=5,
    )
    applied: list[str] = []

    async def handler(event: Message, session: AsyncSession) -> None:
        applied.append(getattr(event, "job_id", ""))

    consumer = EventConsumer(
        db,
        bootstrap="unused:0",
        group_id="sec",
        topics=[topic],
        handler=handler,
        verifier=eventkeys.verifier(),
    )
    source = CatchUpSource(producer="scheduler", target=f"127.0.0.1:{server.port}", token="forger-token")
    try:
        assert await CatchUp(consumer, db, group_id="sec", topics=[topic], sources=[source]).run_once() == 1
    finally:
        await server.stop(0)
    assert applied == ["genuine"]


def test_no_forge_event_header_is_binary() -> None:
    """Signatures travel as text, so tools that print headers keep working."""
    headers = eventkeys.signer("eval").headers(topic=PROMOTIONS, event_type="t", event_id="i", payload=b"x")
    assert all(re.fullmatch(rb"[A-Za-z0-9_.\-]+", value) for _, value in headers)


# --- the broker's own gate (Compose / Kubernetes) -------------------------------------------------


def test_broker_acls_let_each_service_write_only_its_own_topics() -> None:
    """deploy/kafka/setup.sh: a Write grant exists only for a topic's owner; Read grants only for
    the topics a consumer actually consumes, in its own group; no wildcard, no cluster grant."""
    from forge_kit.events import TOPIC_OWNERS

    script = (Path(__file__).resolve().parents[2] / "deploy" / "kafka" / "setup.sh").read_text()
    grants = [line.split() for line in script.splitlines() if line.startswith("acl ")]
    assert grants
    writes = {(g[1], g[g.index("--topic") + 1]) for g in grants if "Write" in g}
    assert writes == {(owner, topic) for topic, owner in TOPIC_OWNERS.items()}
    consumed = {(g[1], g[g.index("--topic") + 1]) for g in grants if "Read" in g and "--topic" in g}
    assert consumed == {
        ("orchestrator", topic_for(events_pb2.JobStateChanged())),
        ("orchestrator", topic_for(events_pb2.CheckpointPublished())),
        # The orchestrator's tracking consumer (group orchestrator-tracking) records runs in MLflow.
        ("orchestrator", topic_for(events_pb2.TrainingMetrics())),
        ("orchestrator", topic_for(events_pb2.EvalCompleted())),
        ("inference_gateway", PROMOTIONS),
        ("retriever", DOCS),
    }
    assert all("*" not in " ".join(g) and "--cluster" not in g for g in grants)
