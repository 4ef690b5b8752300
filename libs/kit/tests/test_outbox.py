"""The kit's one outbox relay (pipelined batches, the acknowledged prefix marked published) and
``stage_event_sync``, against a real broker and real SQLite databases."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest
import sqlalchemy as sa
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError
from forge.events.v1 import events_pb2

from forge_kit.db import Base, Database
from forge_kit.events import (
    KafkaPublisher,
    OutboxEvent,
    decode_event,
    ensure_topics,
    stage_event,
    stage_event_sync,
    topic_for,
)
from forge_kit.outbox import OutboxRelay, mark_published_statement
from forge_kit.testing import TansuBroker, eventkeys

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

TOPIC = topic_for(events_pb2.JobStateChanged())


async def stage(db: Database, job_id: str, state: int = 2) -> events_pb2.JobStateChanged:
    async with db.session() as session:
        event = events_pb2.JobStateChanged(job_id=job_id, team="research", state=state)
        await stage_event(session, event, producer="scheduler", key=job_id)
    return event


async def read_topic(bootstrap: str, job_id: str, count: int) -> list[events_pb2.JobStateChanged]:
    """This test's events on the (shared) topic, in the order their partition holds them."""
    consumer = AIOKafkaConsumer(TOPIC, bootstrap_servers=bootstrap, auto_offset_reset="earliest")
    await consumer.start()
    found: list[events_pb2.JobStateChanged] = []
    try:
        deadline = time.monotonic() + 30
        while len(found) < count and time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=500)
            for records in batches.values():
                for record in records:
                    event = decode_event(events_pb2.JobStateChanged.DESCRIPTOR.full_name, record.value)
                    if getattr(event, "job_id", "") == job_id:
                        found.append(event)  # type: ignore[arg-type]
    finally:
        await consumer.stop()
    return found


@pytest.mark.asyncio
async def test_batches_go_out_whole_in_sequence_order_and_are_marked(
    db: Database, kafka_broker: TansuBroker
) -> None:
    await ensure_topics(kafka_broker.bootstrap, [TOPIC], partitions=3)
    job_id = f"job-{uuid.uuid4().hex}"
    staged = [await stage(db, job_id, state) for state in (1, 2, 3, 4, 5)]
    marks: list[list[int]] = []

    async def mark(sequences: Sequence[int], when: dt.datetime) -> None:
        marks.append(list(sequences))
        async with db.session() as session:
            await session.execute(mark_published_statement(sequences, when))

    publisher = KafkaPublisher(kafka_broker.bootstrap)
    relay = OutboxRelay(
        db, publisher, signer=eventkeys.signer("scheduler"), batch_size=2, mark_published=mark
    )
    try:
        assert [await relay.relay_once() for _ in range(4)] == [2, 2, 1, 0]
    finally:
        await publisher.close()
    sequences = [e.meta.sequence for e in staged]
    assert marks == [sequences[0:2], sequences[2:4], sequences[4:5]]
    assert await relay.pending() == 0
    # One key, one partition: the states arrive in the order they were staged.
    received = await read_topic(kafka_broker.bootstrap, job_id, 5)
    assert [e.state for e in received] == [1, 2, 3, 4, 5]
    assert [e.meta.event_id for e in received] == [e.meta.event_id for e in staged]


@pytest.mark.asyncio
async def test_a_broker_that_is_away_publishes_nothing_and_loses_nothing(db: Database) -> None:
    await stage(db, f"job-{uuid.uuid4().hex}")
    away = KafkaPublisher("127.0.0.1:1", request_timeout_ms=1_000)
    relay = OutboxRelay(db, away, signer=eventkeys.signer("scheduler"))
    try:
        with pytest.raises((KafkaError, OSError)):
            await asyncio.wait_for(relay.relay_once(), timeout=30)
    finally:
        await away.close()
    assert await relay.pending() == 1


def test_stage_event_sync_writes_the_row_in_the_callers_transaction(tmp_path: Path) -> None:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'sync.db'}")
    Base.metadata.create_all(engine)
    with engine.begin() as conn:
        first = stage_event_sync(conn, events_pb2.JobStateChanged(job_id="a"), producer="scheduler", key="a")
        second = stage_event_sync(conn, events_pb2.JobStateChanged(job_id="b"), producer="scheduler")
    with pytest.raises(RuntimeError), engine.begin() as conn:
        stage_event_sync(conn, events_pb2.JobStateChanged(job_id="lost"), producer="scheduler")
        raise RuntimeError("the unit failed")
    with engine.connect() as conn:
        rows = conn.execute(sa.select(OutboxEvent.__table__).order_by(OutboxEvent.sequence)).all()
    engine.dispose()
    assert [r.event_id for r in rows] == [first.meta.event_id, second.meta.event_id]
    assert first.meta.sequence == rows[0].sequence < second.meta.sequence == rows[1].sequence
    assert first.meta.producer == "scheduler" and rows[0].key == b"a" and rows[1].key is None
    assert rows[0].topic == TOPIC and rows[0].published_at is None
    decoded = decode_event(rows[0].event_type, rows[0].payload)
    assert decoded == first
