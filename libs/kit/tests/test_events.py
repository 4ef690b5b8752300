"""Events against a real Tansu broker: outbox, idempotent consumer, crash and broker-down recovery."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import pytest_asyncio
import sqlalchemy as sa
from aiokafka import ConsumerRecord
from forge.events.v1 import events_pb2
from google.protobuf.message import Message
from sqlalchemy.ext.asyncio import AsyncSession

from forge_kit.consumer import EventConsumer
from forge_kit.db import Base, Database
from forge_kit.events import (
    HEADER_TYPE,
    DeadLetter,
    KafkaPublisher,
    OutboxEvent,
    ProcessedEvent,
    decode_event,
    ensure_topics,
    stage_event,
    topic_for,
)
from forge_kit.outbox import OutboxRelay
from forge_kit.testing import TansuBroker, eventkeys, eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]  # a wait is up to 60 s on a loaded machine

TOPIC = topic_for(events_pb2.JobStateChanged())
HERE = Path(__file__).parent


@pytest_asyncio.fixture
async def db(tmp_path: Path) -> AsyncIterator[Database]:
    database = Database(f"sqlite+aiosqlite:///{tmp_path / 'events.db'}")
    async with database.engine.begin() as connection:
        await connection.run_sync(Base.metadata.create_all)
        await connection.execute(sa.text("CREATE TABLE counters (name TEXT PRIMARY KEY, n INTEGER NOT NULL)"))
    yield database
    await database.dispose()


@pytest_asyncio.fixture
async def broker(kafka_broker: TansuBroker) -> TansuBroker:
    await ensure_topics(kafka_broker.bootstrap, [TOPIC], partitions=3)
    return kafka_broker


class Collector:
    """A consumer handler that records this test's events (the topic is shared across tests)."""

    def __init__(self, job_ids: set[str], fail_for: set[str] | None = None) -> None:
        self.job_ids = job_ids
        self.fail_for = fail_for or set()
        self.events: list[Message] = []
        self.attempts: dict[str, int] = {}

    async def __call__(self, event: Message, session: AsyncSession) -> None:
        job_id = getattr(event, "job_id", "")
        if job_id not in self.job_ids:
            return
        self.attempts[job_id] = self.attempts.get(job_id, 0) + 1
        if job_id in self.fail_for:
            raise RuntimeError(f"cannot apply {job_id}")
        self.events.append(event)

    def seen(self, job_id: str) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            return any(getattr(e, "job_id", "") == job_id for e in self.events)

        return check


def consumer(
    db: Database, broker: TansuBroker, handler: Collector, group: str | None = None, **kw: object
) -> EventConsumer:
    return EventConsumer(
        db,
        bootstrap=broker.bootstrap,
        group_id=group or f"test-{uuid.uuid4().hex}",
        topics=[TOPIC],
        handler=handler,
        session_timeout_ms=1500,
        verifier=eventkeys.verifier(),
        **kw,  # type: ignore[arg-type]
    )


async def stage(db: Database, job_id: str) -> events_pb2.JobStateChanged:
    async with db.session() as session:
        event = events_pb2.JobStateChanged(job_id=job_id, team="research", state=2)
        await stage_event(session, event, producer="scheduler", key=job_id)
    return event


@pytest.mark.asyncio
async def test_outbox_relay_publishes_committed_events_and_nothing_else(
    db: Database, broker: TansuBroker
) -> None:
    committed, rolled_back = f"job-{uuid.uuid4().hex}", f"job-{uuid.uuid4().hex}"
    staged = await stage(db, committed)
    with pytest.raises(RuntimeError):
        async with db.session() as session:
            await stage_event(session, events_pb2.JobStateChanged(job_id=rolled_back), producer="scheduler")
            raise RuntimeError("the database write failed")
    publisher = KafkaPublisher(broker.bootstrap, signer=eventkeys.signer("scheduler"))
    relay = OutboxRelay(db, publisher, signer=eventkeys.signer("scheduler"))
    assert await relay.pending() == 1
    assert await relay.relay_once() == 1
    assert await relay.pending() == 0
    assert await relay.relay_once() == 0

    handler = Collector({committed, rolled_back})
    events = consumer(db, broker, handler)
    task = asyncio.create_task(events.run())
    try:
        await eventually(handler.seen(committed), what="the committed event")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await events.stop()
        await publisher.close()

    [received] = handler.events
    assert isinstance(received, events_pb2.JobStateChanged)
    assert received.team == "research"
    assert received.meta.event_id == staged.meta.event_id
    assert received.meta.producer == "scheduler"
    async with db.session() as session:
        row = await session.scalar(sa.select(OutboxEvent).where(OutboxEvent.event_id == staged.meta.event_id))
    assert row is not None
    assert row.published_at is not None
    assert received.meta.sequence == row.sequence > 0
    assert received.meta.occurred_at.seconds > 0


@pytest.mark.asyncio
async def test_sequences_increase_in_staging_order(db: Database) -> None:
    first = await stage(db, "a")
    second = await stage(db, "b")
    assert first.meta.sequence < second.meta.sequence
    assert first.meta.event_id != second.meta.event_id


@pytest.mark.asyncio
async def test_consumer_crash_after_db_commit_does_not_apply_the_event_twice(
    db: Database, broker: TansuBroker, tmp_path: Path
) -> None:
    job_id = f"job-{uuid.uuid4().hex}"
    group = f"crash-{uuid.uuid4().hex}"
    async with db.session() as session:
        await session.execute(sa.text("INSERT INTO counters (name, n) VALUES (:name, 0)"), {"name": job_id})
    staged = await stage(db, job_id)
    publisher = KafkaPublisher(broker.bootstrap, signer=eventkeys.signer("scheduler"))
    assert await OutboxRelay(db, publisher, signer=eventkeys.signer("scheduler")).relay_once() == 1
    await publisher.close()

    crashed = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, str(HERE / "crash_consumer.py"), broker.bootstrap, db.url, group, TOPIC, job_id],
        timeout=45,
        capture_output=True,
    )
    assert crashed.returncode == -9, crashed.stderr.decode()[-2000:]

    async def count() -> int:
        async with db.session() as session:
            return int(
                await session.scalar(sa.text("SELECT n FROM counters WHERE name = :name"), {"name": job_id})
            )

    assert await count() == 1

    # A fresh member of the same group is handed the uncommitted record again.
    handler = Collector({job_id})
    events = consumer(db, broker, handler, group=group)
    outcomes: list[bool] = []
    apply = events.handle

    async def recording(record: ConsumerRecord) -> bool:  # type: ignore[type-arg]
        applied = await apply(record)
        headers = {k: v.decode() for k, v in (record.headers or ())}
        if getattr(decode_event(headers[HEADER_TYPE], record.value), "job_id", "") == job_id:
            outcomes.append(applied)
        return applied

    events.handle = recording  # type: ignore[method-assign]
    task = asyncio.create_task(events.run())

    async def redelivered() -> bool:
        return bool(outcomes)

    try:
        await eventually(redelivered, what="the record to be delivered again")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await events.stop()
    assert outcomes == [False]  # delivered again, skipped as a duplicate
    assert handler.attempts == {}
    assert await count() == 1
    async with db.session() as session:
        processed = await session.get(ProcessedEvent, (group, staged.meta.event_id))
    assert processed is not None


@pytest.mark.asyncio
async def test_failing_handler_dead_letters_the_event_and_the_partition_moves_on(
    db: Database, broker: TansuBroker
) -> None:
    poison, good = f"job-{uuid.uuid4().hex}", f"job-{uuid.uuid4().hex}"
    publisher = KafkaPublisher(broker.bootstrap, signer=eventkeys.signer("scheduler"))
    # Same key, so both land on one partition: the good one is behind the poison one.
    await publisher.publish(events_pb2.JobStateChanged(job_id=poison), key="same")
    await publisher.publish(events_pb2.JobStateChanged(job_id=good), key="same")
    # And a record nobody can decode (signed by the owner all the same), on the same partition.
    garbage = b"\xff\x00garbage"
    headers = eventkeys.signer("scheduler").headers(
        topic=TOPIC, event_type="forge.nope.v1.Nope", event_id="nope-1", payload=garbage
    )
    await publisher.send(TOPIC, garbage, key=b"same", headers=headers)
    await publisher.publish(events_pb2.JobStateChanged(job_id=good + "-2"), key="same")
    await publisher.close()

    handler = Collector({poison, good, good + "-2"}, fail_for={poison})
    group = f"dlq-{uuid.uuid4().hex}"
    events = consumer(db, broker, handler, group=group, max_attempts=2)
    task = asyncio.create_task(events.run())
    try:
        await eventually(handler.seen(good + "-2"), what="the events behind the poison ones")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await events.stop()
    assert handler.attempts[poison] == 2
    assert [getattr(e, "job_id", "") for e in handler.events] == [good, good + "-2"]
    async with db.session() as session:
        letters = (
            await session.scalars(sa.select(DeadLetter).where(DeadLetter.consumer_group == group))
        ).all()
    assert len(letters) == 2
    assert "cannot apply" in letters[0].error
    assert decode_event(letters[0].event_type, letters[0].payload).job_id == poison  # type: ignore[attr-defined]
    assert letters[1].event_type == "forge.nope.v1.Nope"
    assert letters[0].offset < letters[1].offset


@pytest.mark.asyncio
async def test_outbox_keeps_events_while_the_broker_is_down_and_delivers_after_restart(
    db: Database, broker: TansuBroker
) -> None:
    job_id = f"job-{uuid.uuid4().hex}"
    publisher = KafkaPublisher(broker.bootstrap, request_timeout_ms=2000)
    relay = OutboxRelay(
        db, publisher, signer=eventkeys.signer("scheduler"), poll_interval_s=0.1, max_backoff_s=0.5
    )
    task: asyncio.Task[None] | None = None
    broker.stop()
    try:
        await stage(db, job_id)
        task = asyncio.create_task(relay.run())
        await asyncio.sleep(1.5)
        assert not task.done()
        assert await relay.pending() == 1

        broker.start()
        await ensure_topics(broker.bootstrap, [TOPIC], partitions=3)  # memory storage: topics are gone
        relay.wake()

        async def drained() -> bool:
            return await relay.pending() == 0

        await eventually(drained, timeout_s=30, what="the outbox to drain")
    finally:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await publisher.close()
        if broker.proc is None:
            broker.start()
            await ensure_topics(broker.bootstrap, [TOPIC], partitions=3)

    handler = Collector({job_id})
    events = consumer(db, broker, handler)
    run = asyncio.create_task(events.run())
    try:
        await eventually(handler.seen(job_id), what="the event published after the restart")
    finally:
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        await events.stop()
    assert len(handler.events) == 1


@pytest.mark.asyncio
async def test_consumer_lag_counts_unhandled_records_and_falls_to_zero(
    db: Database, broker: TansuBroker
) -> None:
    """While the handler is stuck on the first of five events, the lag shows the records not
    yet handled; once they are, it is 0."""
    from prometheus_client import REGISTRY

    job = f"job-{uuid.uuid4().hex}"
    publisher = KafkaPublisher(broker.bootstrap, signer=eventkeys.signer("scheduler"))
    for n in range(5):
        await publisher.publish(events_pb2.JobStateChanged(job_id=f"{job}-{n}"), key=job)
    await publisher.close()
    release = asyncio.Event()
    handled: list[str] = []

    async def slow_handler(event: Message, session: AsyncSession) -> None:
        job_id = getattr(event, "job_id", "")
        if job_id.startswith(job):
            await release.wait()
            handled.append(job_id)

    group = f"lag-{uuid.uuid4().hex}"
    events = EventConsumer(
        db,
        bootstrap=broker.bootstrap,
        group_id=group,
        topics=[TOPIC],
        handler=slow_handler,
        session_timeout_ms=1500,
        verifier=eventkeys.verifier(),
    )
    task = asyncio.create_task(events.run())

    def lag() -> float:
        return sum(
            sample.value
            for metric in REGISTRY.collect()
            if metric.name == "forge_consumer_lag"
            for sample in metric.samples
            if sample.labels.get("group") == group
        )

    async def behind() -> bool:
        return lag() >= 5

    async def caught_up() -> bool:
        return len(handled) == 5 and lag() == 0

    try:
        await eventually(behind, what="a lag of at least the five unhandled events")
        release.set()
        await eventually(caught_up, what="lag 0 once the five events are handled")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await events.stop()
