"""Catch-up from the owner's outbox: the EventLogService on a real gRPC server, and a consumer
that recovers events the broker lost (a real Tansu restart)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
import sqlalchemy as sa
from forge.events.v1 import events_pb2, events_pb2_grpc
from google.protobuf.message import Message
from sqlalchemy.ext.asyncio import AsyncSession

from forge_kit.consumer import EventConsumer
from forge_kit.db import Base, Database
from forge_kit.eventlog import CatchUp, CatchUpSource, CatchUpWatermark, EventLogApi
from forge_kit.events import KafkaPublisher, ensure_topics, stage_event, topic_for
from forge_kit.grpckit import FIELD_METADATA_KEY, GrpcServer, make_channel
from forge_kit.outbox import OutboxRelay
from forge_kit.testing import TansuBroker, eventkeys, eventually
from forge_kit.testing.grpcserver import grpc_test_server

TOKEN = "eventlog-token"
JOBS = topic_for(events_pb2.JobStateChanged())
DOCS = topic_for(events_pb2.DocumentChanged())


async def _database(path: Path) -> Database:
    database = Database(f"sqlite+aiosqlite:///{path}")
    async with database.engine.begin() as connection:
        await connection.run_sync(Base.metadata.create_all)
    return database


@pytest_asyncio.fixture
async def producer_db(tmp_path: Path) -> AsyncIterator[Database]:
    database = await _database(tmp_path / "producer.db")
    yield database
    await database.dispose()


@pytest_asyncio.fixture
async def consumer_db(tmp_path: Path) -> AsyncIterator[Database]:
    database = await _database(tmp_path / "consumer.db")
    yield database
    await database.dispose()


@pytest_asyncio.fixture
async def owner(producer_db: Database) -> AsyncIterator[GrpcServer]:
    api = EventLogApi(producer_db, signer=eventkeys.signer("scheduler"), default_page=2, max_page=50)
    async with grpc_test_server(
        events_pb2_grpc.add_EventLogServiceServicer_to_server,
        api,
        "forge.events.v1.EventLogService",
        token=TOKEN,
        service="producer",
    ) as server:
        yield server


async def stage_jobs(db: Database, job_ids: list[str]) -> None:
    for job_id in job_ids:
        async with db.session() as session:
            await stage_event(
                session, events_pb2.JobStateChanged(job_id=job_id), producer="scheduler", key=job_id
            )


class Recorder:
    """Handler that records the job ids it applies: once its unit of work commits. A call whose
    transaction rolls back applied nothing (the Kafka path and catch-up racing on one event: the
    loser's processed-events row collides with the winner's, and its retry sees a duplicate)."""

    def __init__(self) -> None:
        self.applied: list[str] = []

    async def __call__(self, event: Message, session: AsyncSession) -> None:
        applied = getattr(event, "job_id", "") or getattr(event, "document_id", "")
        sa.event.listen(
            session.sync_session, "after_commit", lambda _: self.applied.append(applied), once=True
        )


def catch_up(
    consumer_db: Database, owner: GrpcServer, recorder: Recorder, bootstrap: str = "127.0.0.1:1"
) -> CatchUp:
    consumer = EventConsumer(
        consumer_db,
        bootstrap=bootstrap,
        group_id="g",
        topics=[JOBS],
        handler=recorder,
        verifier=eventkeys.verifier(),
    )
    source = CatchUpSource(producer="scheduler", target=f"127.0.0.1:{owner.port}", token=TOKEN)
    return CatchUp(consumer, consumer_db, group_id="g", topics=[JOBS], sources=[source], page_size=2)


@pytest.mark.asyncio
async def test_list_events_pages_in_order_and_filters_topics(
    producer_db: Database, owner: GrpcServer
) -> None:
    await stage_jobs(producer_db, ["j1", "j2"])
    async with producer_db.session() as session:
        await stage_event(session, events_pb2.DocumentChanged(document_id="d1"), producer="scheduler")
    await stage_jobs(producer_db, ["j3"])
    async with make_channel(f"127.0.0.1:{owner.port}", token=TOKEN) as channel:
        stub = events_pb2_grpc.EventLogServiceStub(channel)
        first = await stub.ListEvents(events_pb2.ListEventsRequest(topics=[JOBS]))
        second = await stub.ListEvents(
            events_pb2.ListEventsRequest(after_sequence=first.last_sequence, topics=[JOBS])
        )
        everything = await stub.ListEvents(events_pb2.ListEventsRequest(limit=10))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.ListEvents(events_pb2.ListEventsRequest(limit=51))
    assert [events_pb2.JobStateChanged.FromString(e.payload).job_id for e in first.events] == ["j1", "j2"]
    assert first.has_more
    # The second page spans the document event (filtered out) and j3.
    assert [events_pb2.JobStateChanged.FromString(e.payload).job_id for e in second.events] == ["j3"]
    assert not second.has_more and second.last_sequence == 4
    assert [e.topic for e in everything.events] == [JOBS, JOBS, DOCS, JOBS]
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (FIELD_METADATA_KEY, "limit") in tuple(caught.value.trailing_metadata() or ())


@pytest.mark.asyncio
async def test_catch_up_applies_each_event_once_and_resumes_from_its_watermark(
    producer_db: Database, consumer_db: Database, owner: GrpcServer
) -> None:
    recorder = Recorder()
    loop = catch_up(consumer_db, owner, recorder)
    await stage_jobs(producer_db, ["j1", "j2", "j3"])
    assert await loop.run_once() == 3
    assert await loop.run_once() == 0
    await stage_jobs(producer_db, ["j4"])
    assert await loop.run_once() == 1
    assert recorder.applied == ["j1", "j2", "j3", "j4"]
    async with consumer_db.session() as session:
        mark = await session.get(CatchUpWatermark, ("g", "scheduler"))
    assert mark is not None and mark.sequence == 4


@pytest.mark.asyncio
async def test_an_unreachable_owner_is_skipped_not_fatal(consumer_db: Database) -> None:
    recorder = Recorder()
    consumer = EventConsumer(
        consumer_db,
        bootstrap="127.0.0.1:1",
        group_id="g",
        topics=[JOBS],
        handler=recorder,
        verifier=eventkeys.verifier(),
    )
    source = CatchUpSource(producer="scheduler", target="127.0.0.1:1", token=TOKEN)
    loop = CatchUp(consumer, consumer_db, group_id="g", topics=[JOBS], sources=[source], rpc_timeout_s=1)
    assert await loop.run_once() == 0


@pytest.mark.asyncio
async def test_discovered_sources_are_read_each_round_and_a_failed_discovery_is_not_fatal(
    producer_db: Database, consumer_db: Database, owner: GrpcServer
) -> None:
    """Producers that come and go (one trainer agent per node) are named at each round."""
    recorder = Recorder()
    consumer = EventConsumer(
        consumer_db,
        bootstrap="127.0.0.1:1",
        group_id="g",
        topics=[JOBS],
        handler=recorder,
        verifier=eventkeys.verifier(),
    )
    found: list[CatchUpSource] = []
    fail = False

    async def discover() -> list[CatchUpSource]:
        if fail:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata())
        return found

    loop = CatchUp(
        consumer, consumer_db, group_id="g", topics=[JOBS], sources=[], discover=discover, page_size=2
    )
    await stage_jobs(producer_db, ["j1", "j2"])
    assert await loop.run_once() == 0  # nobody found yet
    found.append(CatchUpSource(producer="agent@node-a", target=f"127.0.0.1:{owner.port}", token=TOKEN))
    assert await loop.run_once() == 2
    fail = True
    await stage_jobs(producer_db, ["j3"])
    assert await loop.run_once() == 0
    fail = False
    assert await loop.run_once() == 1
    assert recorder.applied == ["j1", "j2", "j3"]
    async with consumer_db.session() as session:
        mark = await session.get(CatchUpWatermark, ("g", "agent@node-a"))
    assert mark is not None and mark.sequence == 3


@pytest.mark.integration
@pytest.mark.timeout(90)
@pytest.mark.asyncio
async def test_events_the_broker_lost_in_a_restart_are_recovered_from_the_owner(
    kafka_broker: TansuBroker, producer_db: Database, consumer_db: Database, owner: GrpcServer
) -> None:
    """Published to Kafka, then the (memory-only) broker restarts before the consumer read them:
    the Kafka path can never deliver them; catch-up from the owner does, once."""
    await ensure_topics(kafka_broker.bootstrap, [JOBS])
    ids = [f"lost-{uuid.uuid4().hex[:6]}" for _ in range(3)]
    await stage_jobs(producer_db, ids)
    publisher = KafkaPublisher(kafka_broker.bootstrap)
    relay = OutboxRelay(producer_db, publisher, signer=eventkeys.signer("scheduler"))
    try:
        assert await relay.relay_once() == 3
    finally:
        await publisher.close()
    kafka_broker.stop()
    kafka_broker.start()
    await ensure_topics(kafka_broker.bootstrap, [JOBS])

    recorder = Recorder()
    group = f"g-{uuid.uuid4().hex[:6]}"
    consumer = EventConsumer(
        consumer_db,
        bootstrap=kafka_broker.bootstrap,
        group_id=group,
        topics=[JOBS],
        handler=recorder,
        session_timeout_ms=1500,
        verifier=eventkeys.verifier(),
    )
    source = CatchUpSource(producer="scheduler", target=f"127.0.0.1:{owner.port}", token=TOKEN)
    loop = CatchUp(consumer, consumer_db, group_id=group, topics=[JOBS], sources=[source], page_size=50)
    kafka_task = asyncio.create_task(consumer.run())
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not recorder.applied:
            await asyncio.sleep(0.1)
        assert recorder.applied == []  # the broker lost them
        assert await loop.run_once() == 3
        assert sorted(recorder.applied) == sorted(ids)
        # A new event now reaches the consumer over Kafka; catch-up then finds nothing new.
        await stage_jobs(producer_db, ["after-restart"])
        publisher = KafkaPublisher(kafka_broker.bootstrap)
        try:
            await OutboxRelay(producer_db, publisher, signer=eventkeys.signer("scheduler")).relay_once()
        finally:
            await publisher.close()
        await eventually(lambda: "after-restart" in recorder.applied, what="the new event over Kafka")
        assert await loop.run_once() == 0
        assert recorder.applied.count("after-restart") == 1
    finally:
        kafka_task.cancel()
        await asyncio.gather(kafka_task, return_exceptions=True)
        await consumer.stop()
    async with consumer_db.session() as session:
        processed = await session.scalar(sa.text("SELECT count(*) FROM forge_processed_events"))
    assert processed == 4
