"""Kafka events: topics, envelopes, a producer, an idempotent consumer and the transactional outbox.

Every payload is a ``forge.events.v1`` message whose first field is ``EventMeta meta`` (event id,
time, producer, outbox sequence). On the wire a record's value is the serialised message; its
headers carry ``forge-event-type`` (the message's full name), ``forge-event-id`` and
``forge-producer`` so a consumer can decode and dedupe without guessing, and ``forge-key-id`` and
``forge-signature`` (:mod:`forge_kit.eventauth`): a consumer drops and counts any record whose
signature does not verify or whose producer does not own the topic (:data:`OWNERS`, or ``sources``).

Delivery is at least once end to end:

* a service that changes its database stages the event in the same transaction
  (:func:`stage_event`), and :class:`OutboxRelay` publishes staged rows in sequence order,
  retrying with capped, jittered backoff while the broker is away — nothing is lost;
* :class:`EventConsumer` applies each event and records its id in ``forge_processed_events`` in
  one database transaction, then commits the Kafka offset — a crash between the two replays the
  record, and the recorded id turns the replay into a no-op.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import uuid
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from typing import Protocol

import sqlalchemy as sa
import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError
from forge.events.v1 import events_pb2
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.message import Message
from prometheus_client import Counter, Gauge
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Mapped, mapped_column

from forge_kit.backoff import Backoff
from forge_kit.db import Base, Database, utcnow
from forge_kit.eventauth import HEADER_ID as HEADER_ID
from forge_kit.eventauth import HEADER_PRODUCER as HEADER_PRODUCER
from forge_kit.eventauth import HEADER_TYPE as HEADER_TYPE
from forge_kit.eventauth import (
    PLAINTEXT,
    EventSigner,
    EventVerifier,
    KafkaAuth,
    Rejected,
    record_rejection,
)

log = structlog.get_logger(__name__)

#: Topic of each event type, ``forge.<producing service>.<event>.v1``.
TOPICS: dict[str, str] = {
    events_pb2.JobStateChanged.DESCRIPTOR.full_name: "forge.scheduler.job_state_changed.v1",
    events_pb2.CheckpointPublished.DESCRIPTOR.full_name: "forge.trainer.checkpoint_published.v1",
    events_pb2.TrainingMetrics.DESCRIPTOR.full_name: "forge.trainer.training_metrics.v1",
    events_pb2.PreferenceRecorded.DESCRIPTOR.full_name: "forge.preferences.recorded.v1",
    events_pb2.RlhfRoundUpdated.DESCRIPTOR.full_name: "forge.feedback.rlhf_round_updated.v1",
    events_pb2.DocumentChanged.DESCRIPTOR.full_name: "forge.retrieval.document_changed.v1",
    events_pb2.EvalCompleted.DESCRIPTOR.full_name: "forge.eval.eval_completed.v1",
    events_pb2.ModelPromoted.DESCRIPTOR.full_name: "forge.eval.model_promoted.v1",
}

#: The one producer (service name) allowed to publish each event type: the owner of its topic.
OWNERS: dict[str, str] = {
    events_pb2.JobStateChanged.DESCRIPTOR.full_name: "scheduler",
    events_pb2.CheckpointPublished.DESCRIPTOR.full_name: "trainer_agent",
    events_pb2.TrainingMetrics.DESCRIPTOR.full_name: "trainer_agent",
    events_pb2.PreferenceRecorded.DESCRIPTOR.full_name: "preference_feedback",
    events_pb2.RlhfRoundUpdated.DESCRIPTOR.full_name: "preference_feedback",
    events_pb2.DocumentChanged.DESCRIPTOR.full_name: "retriever",
    events_pb2.EvalCompleted.DESCRIPTOR.full_name: "eval",
    events_pb2.ModelPromoted.DESCRIPTOR.full_name: "eval",
}

#: Topic → the producer that owns it.
TOPIC_OWNERS: dict[str, str] = {TOPICS[name]: owner for name, owner in OWNERS.items()}

EVENTS_PUBLISHED = Counter("forge_events_published_total", "Events sent to Kafka", ["topic"])
EVENTS_CONSUMED = Counter("forge_events_consumed_total", "Events handled", ["group", "topic", "outcome"])
OUTBOX_PENDING = Gauge("forge_outbox_pending", "Outbox rows not yet published")
CONSUMER_LAG = Gauge(
    "forge_consumer_lag",
    "Records on the partition not yet handled by the group (high watermark - position)",
    ["group", "topic", "partition"],
)


def topic_for(message: Message) -> str:
    """The topic an event message belongs on."""
    name = message.DESCRIPTOR.full_name
    try:
        return TOPICS[name]
    except KeyError:
        raise ValueError(f"{name} is not a forge.events.v1 event") from None


def decode_event(event_type: str, payload: bytes) -> Message:
    """Parse ``payload`` as the message named ``event_type``."""
    descriptor = descriptor_pool.Default().FindMessageTypeByName(event_type)
    message = message_factory.GetMessageClass(descriptor)()
    message.ParseFromString(payload)
    return message


def new_meta(producer: str, sequence: int = 0) -> events_pb2.EventMeta:
    """Fresh event metadata: a random id, the current UTC time and the producer's name."""
    meta = events_pb2.EventMeta(event_id=str(uuid.uuid4()), producer=producer, sequence=sequence)
    meta.occurred_at.GetCurrentTime()
    return meta


class OutboxEvent(Base):
    """An event staged in the producer's database; ``sequence`` orders and names it for replay."""

    __tablename__ = "forge_outbox"

    sequence: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=True)
    event_id: Mapped[str] = mapped_column(sa.String(64), unique=True)
    topic: Mapped[str] = mapped_column(sa.String(255))
    key: Mapped[bytes | None] = mapped_column(sa.LargeBinary, nullable=True)
    event_type: Mapped[str] = mapped_column(sa.String(255))
    payload: Mapped[bytes] = mapped_column(sa.LargeBinary)
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow)
    published_at: Mapped[dt.datetime | None] = mapped_column(sa.DateTime, nullable=True, index=True)


class ProcessedEvent(Base):
    """An event a consumer group has applied; the primary key makes a second apply impossible."""

    __tablename__ = "forge_processed_events"

    consumer_group: Mapped[str] = mapped_column(sa.String(255), primary_key=True)
    event_id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    topic: Mapped[str] = mapped_column(sa.String(255))
    processed_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow)


class DeadLetter(Base):
    """An event whose handler kept failing; kept for inspection and replay instead of blocking."""

    __tablename__ = "forge_dead_letters"

    id: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=True)
    consumer_group: Mapped[str] = mapped_column(sa.String(255))
    topic: Mapped[str] = mapped_column(sa.String(255))
    partition: Mapped[int] = mapped_column(sa.Integer)
    offset: Mapped[int] = mapped_column(sa.BigInteger)
    event_type: Mapped[str] = mapped_column(sa.String(255))
    payload: Mapped[bytes] = mapped_column(sa.LargeBinary)
    error: Mapped[str] = mapped_column(sa.Text)
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow)


async def stage_event(session: AsyncSession, message: Message, *, producer: str, key: str = "") -> Message:
    """Stage ``message`` in the outbox inside the caller's transaction; fills its ``meta``.

    The row is published only if the caller's transaction commits, and it is never lost once it
    has: that is the whole point of the outbox.
    """
    row = OutboxEvent(
        event_id=str(uuid.uuid4()),
        topic=topic_for(message),
        key=key.encode() if key else None,
        event_type=message.DESCRIPTOR.full_name,
        payload=b"",
    )
    session.add(row)
    await session.flush()
    meta = new_meta(producer, sequence=row.sequence)
    meta.event_id = row.event_id
    message.meta.CopyFrom(meta)  # type: ignore[attr-defined]
    row.payload = message.SerializeToString()
    return message


class Publisher(Protocol):
    """Sends one record to Kafka. Called by :class:`OutboxRelay` and by direct publishers."""

    async def send(
        self, topic: str, value: bytes, *, key: bytes | None, headers: list[tuple[str, bytes]]
    ) -> None:
        """Send and wait for the broker's acknowledgement; raise on failure."""


class KafkaPublisher:
    """aiokafka producer with ``acks=all``; idempotence only where the broker supports it.

    ``signer`` signs what :meth:`publish` sends (the relay signs outbox rows itself)."""

    def __init__(
        self,
        bootstrap: str,
        *,
        signer: EventSigner | None = None,
        auth: KafkaAuth = PLAINTEXT,
        idempotent: bool = False,
        request_timeout_ms: int = 10_000,
    ) -> None:
        self._bootstrap = bootstrap
        self.signer = signer
        self._auth = auth
        self._idempotent = idempotent
        self._timeout_ms = request_timeout_ms
        self._producer: AIOKafkaProducer | None = None

    async def _ensure(self) -> AIOKafkaProducer:
        if self._producer is None:
            producer = AIOKafkaProducer(
                bootstrap_servers=self._bootstrap,
                acks="all",
                enable_idempotence=self._idempotent,
                request_timeout_ms=self._timeout_ms,
                linger_ms=5,
                **self._auth.client_options(),
            )
            try:
                await producer.start()
            except BaseException:
                await producer.stop()
                raise
            self._producer = producer
        return self._producer

    async def send(
        self, topic: str, value: bytes, *, key: bytes | None, headers: list[tuple[str, bytes]]
    ) -> None:
        producer = await self._ensure()
        try:
            await producer.send_and_wait(topic, value, key=key, headers=headers)
        except KafkaError:
            # A producer that lost the broker may stay wedged; rebuild it on the next attempt.
            await self.close()
            raise
        EVENTS_PUBLISHED.labels(topic).inc()

    async def publish(self, message: Message, *, key: str = "") -> Message:
        """Send an event directly (no database write precedes it), signed by this publisher's
        signer, whose name becomes the event's producer."""
        if self.signer is None:
            raise RuntimeError("this publisher has no event signer; events must be signed")
        if not message.meta.event_id:  # type: ignore[attr-defined]
            message.meta.CopyFrom(new_meta(self.signer.producer))  # type: ignore[attr-defined]
        meta = message.meta  # type: ignore[attr-defined]
        if meta.producer != self.signer.producer:
            raise ValueError(
                f"event names producer {meta.producer!r}, the signer is {self.signer.producer!r}"
            )
        topic, payload = topic_for(message), message.SerializeToString()
        await self.send(
            topic,
            payload,
            key=key.encode() if key else None,
            headers=self.signer.headers(topic, message.DESCRIPTOR.full_name, meta.event_id, payload),
        )
        return message

    async def close(self) -> None:
        if self._producer is not None:
            producer, self._producer = self._producer, None
            await producer.stop()


class OutboxRelay:
    """Publishes staged outbox rows in sequence order and marks them published.

    Started once per service process next to its servers. Rows are kept after publishing for
    ``retention`` so that a consumer which missed them (the local broker keeps nothing across a
    restart) can be replayed from the owner by sequence number. Each record is signed by
    ``signer``, whose name is the producer the rows were staged for.
    """

    def __init__(
        self,
        db: Database,
        publisher: Publisher,
        *,
        signer: EventSigner,
        batch_size: int = 100,
        poll_interval_s: float = 0.5,
        max_backoff_s: float = 10.0,
        retention: dt.timedelta = dt.timedelta(days=7),
    ) -> None:
        self._db = db
        self._publisher = publisher
        self._signer = signer
        self._batch_size = batch_size
        self._poll_interval_s = poll_interval_s
        self._max_backoff_s = max_backoff_s
        self._retention = retention
        self._wake = asyncio.Event()

    def wake(self) -> None:
        """Ask the relay to look for new rows now instead of at the next poll."""
        self._wake.set()

    async def relay_once(self) -> int:
        """Publish up to one batch; return how many rows were published. Raises on send failure."""
        async with self._db.session() as session:
            rows = (
                await session.scalars(
                    sa.select(OutboxEvent)
                    .where(OutboxEvent.published_at.is_(None))
                    .order_by(OutboxEvent.sequence)
                    .limit(self._batch_size)
                )
            ).all()
            sent = 0
            try:
                for row in rows:
                    await self._publisher.send(
                        row.topic,
                        row.payload,
                        key=row.key,
                        headers=self._signer.headers(row.topic, row.event_type, row.event_id, row.payload),
                    )
                    row.published_at = utcnow()
                    sent += 1
            finally:
                # Keep the rows that did go out marked, even when a later one failed.
                await session.commit()
        return sent

    async def pending(self) -> int:
        """Rows staged but not yet published."""
        async with self._db.session() as session:
            count = await session.scalar(
                sa.select(sa.func.count()).select_from(OutboxEvent).where(OutboxEvent.published_at.is_(None))
            )
        return int(count or 0)

    async def prune(self) -> int:
        """Delete published rows older than the retention window."""
        cutoff = utcnow() - self._retention
        async with self._db.session() as session:
            result = await session.execute(
                sa.delete(OutboxEvent).where(
                    OutboxEvent.published_at.is_not(None), OutboxEvent.published_at < cutoff
                )
            )
        return int(result.rowcount or 0)  # type: ignore[attr-defined]

    async def run(self) -> None:
        """Relay forever: drain, then sleep until woken or the poll interval passes."""
        backoff = Backoff(0.4, self._max_backoff_s)
        while True:
            # Cleared before looking, so a wake() during relay_once() is not lost.
            self._wake.clear()
            try:
                sent = await self.relay_once()
                backoff.reset()
                OUTBOX_PENDING.set(await self.pending())
                if sent == self._batch_size:
                    continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the broker being away is expected
                delay = backoff.next_delay()
                log.warning("outbox.publish_failed", error=repr(exc), retry_in_s=round(delay, 2))
                await asyncio.sleep(delay)
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self._poll_interval_s)


Handler = Callable[[Message, AsyncSession], Awaitable[None]]


class EventConsumer:
    """Consumes topics in a consumer group and applies each event exactly once to the database.

    For each record: 1. decode it by its type header; 2. in one transaction, skip it if its event
    id is already recorded for this group, else run the handler and record the id; 3. commit the
    offset. A handler that keeps failing (``max_attempts``) sends the record to
    ``forge_dead_letters`` so one bad event cannot stall its partition.

    Before any of that, ``verifier`` authenticates the record's producer, which must own the
    topic (:data:`TOPIC_OWNERS`) or be listed for it in ``sources``; a record that fails is
    dropped (not dead-lettered: a forger must not fill the database), counted in
    ``forge_events_rejected_total`` and logged.
    """

    def __init__(
        self,
        db: Database,
        *,
        bootstrap: str,
        group_id: str,
        topics: Sequence[str],
        handler: Handler,
        verifier: EventVerifier,
        sources: Mapping[str, Collection[str]] | None = None,
        auth: KafkaAuth = PLAINTEXT,
        max_attempts: int = 3,
        auto_offset_reset: str = "earliest",
        session_timeout_ms: int = 10_000,
    ) -> None:
        self._db = db
        self._bootstrap = bootstrap
        self._group_id = group_id
        self._topics = list(topics)
        self._verifier = verifier
        self._auth = auth
        self._allowed: dict[str, frozenset[str]] = {
            topic: frozenset({TOPIC_OWNERS[topic], *(sources or {}).get(topic, ())})
            for topic in {*self._topics, *(sources or {})}
            if topic in TOPIC_OWNERS
        }
        missing = sorted({p for allowed in self._allowed.values() for p in allowed} - verifier.producers)
        if missing:
            log.warning("consumer.no_verify_key", group=group_id, producers=missing)
        self._handler = handler
        self._max_attempts = max_attempts
        self._auto_offset_reset = auto_offset_reset
        # How soon a dead member's partitions move to a live one; a join also waits about this long.
        self._session_timeout_ms = session_timeout_ms
        self._consumer: AIOKafkaConsumer | None = None
        self._committed: dict[TopicPartition, int | None] = {}
        """Offset committed per partition, as far as this consumer knows (for the lag gauge)."""

    async def start(self) -> None:
        """Join the group; retries with jittered backoff while the broker is unreachable."""
        backoff = Backoff(0.2, 5.0)
        while True:
            consumer = AIOKafkaConsumer(
                *self._topics,
                bootstrap_servers=self._bootstrap,
                group_id=self._group_id,
                enable_auto_commit=False,
                auto_offset_reset=self._auto_offset_reset,
                session_timeout_ms=self._session_timeout_ms,
                heartbeat_interval_ms=max(100, min(1_000, self._session_timeout_ms // 3)),
                **self._auth.client_options(),
            )
            try:
                await consumer.start()
            except KafkaError as exc:
                await consumer.stop()
                log.warning("consumer.start_failed", group=self._group_id, error=repr(exc))
                await backoff.sleep()
                continue
            self._consumer = consumer
            return

    def authenticate(self, record: ConsumerRecord) -> str:  # type: ignore[type-arg]
        """The record's producer once its signature verifies and it may publish on the topic;
        raises :class:`~forge_kit.eventauth.Rejected` otherwise."""
        raw = dict(record.headers or ())
        producer = self._verifier.verify(topic=record.topic, headers=raw, payload=record.value or b"")
        if producer not in self._allowed.get(record.topic, ()):
            raise Rejected("wrong_producer", f"{producer!r} may not publish on {record.topic}")
        return producer

    async def handle(self, record: ConsumerRecord) -> bool:  # type: ignore[type-arg]
        """Apply one record; True when the handler ran, False when it was a duplicate or rejected."""
        headers = {k: v.decode(errors="replace") for k, v in (record.headers or ())}
        event_type = headers.get(HEADER_TYPE, "")
        try:
            producer = self.authenticate(record)
        except Rejected as exc:
            record_rejection(self._group_id, record.topic, exc, offset=record.offset, type=event_type[:255])
            return False
        try:
            event = decode_event(event_type, record.value)
        except Exception as exc:  # noqa: BLE001 - a record nobody can decode must not stall the partition
            log.warning("consumer.undecodable", group=self._group_id, event_type=event_type, error=repr(exc))
            await self._dead_letter(record, event_type, f"undecodable: {exc!r}")
            return False
        if event.meta.producer != producer:  # type: ignore[attr-defined]
            named = str(event.meta.producer)[:64]  # type: ignore[attr-defined]
            mismatch = Rejected("wrong_producer", f"signed by {producer!r}, payload names {named!r}")
            record_rejection(self._group_id, record.topic, mismatch, offset=record.offset)
            return False
        event_id = headers.get(HEADER_ID) or event.meta.event_id  # type: ignore[attr-defined]
        backoff = Backoff(0.2, 30.0)
        for attempt in range(1, self._max_attempts + 1):
            try:
                async with self._db.session() as session:
                    seen = await session.get(ProcessedEvent, (self._group_id, event_id))
                    if seen is not None:
                        EVENTS_CONSUMED.labels(self._group_id, record.topic, "duplicate").inc()
                        return False
                    await self._handler(event, session)
                    session.add(
                        ProcessedEvent(consumer_group=self._group_id, event_id=event_id, topic=record.topic)
                    )
                EVENTS_CONSUMED.labels(self._group_id, record.topic, "applied").inc()
                return True
            except Exception as exc:  # noqa: BLE001 - a handler error must not kill the consumer
                log.warning(
                    "consumer.handler_failed",
                    group=self._group_id,
                    event_id=event_id,
                    attempt=attempt,
                    error=repr(exc),
                )
                if attempt == self._max_attempts:
                    await self._dead_letter(record, event_type, repr(exc))
                    return False
                await backoff.sleep()
        return False

    async def _dead_letter(self, record: ConsumerRecord, event_type: str, error: str) -> None:  # type: ignore[type-arg]
        async with self._db.session() as session:
            session.add(
                DeadLetter(
                    consumer_group=self._group_id,
                    topic=record.topic,
                    partition=record.partition,
                    offset=record.offset,
                    event_type=event_type,
                    payload=record.value or b"",
                    error=error,
                )
            )
        EVENTS_CONSUMED.labels(self._group_id, record.topic, "dead_letter").inc()

    async def run(self) -> None:
        """Consume until cancelled."""
        if self._consumer is None:
            await self.start()
        assert self._consumer is not None
        consumer = self._consumer
        while True:
            batches = await consumer.getmany(timeout_ms=500, max_records=100)
            await self._export_lag(consumer)
            for tp, records in batches.items():
                for record in records:
                    await self.handle(record)
                    try:
                        await consumer.commit({TopicPartition(tp.topic, tp.partition): record.offset + 1})
                    except KafkaError as exc:
                        # Lost the partition (rebalance) or the broker: whoever reads it next
                        # replays from the last committed offset, and dedupe makes that harmless.
                        log.warning("consumer.commit_failed", group=self._group_id, error=repr(exc))
                        break
                    self._committed[TopicPartition(tp.topic, tp.partition)] = record.offset + 1
            if batches:
                await self._export_lag(consumer)

    async def _export_lag(self, consumer: AIOKafkaConsumer) -> None:
        """``forge_consumer_lag`` per assigned partition: the last fetch's high watermark less the
        group's committed offset — records on the broker this group has not handled yet, fetched
        or not. The committed offset is asked of the broker once per partition, then followed
        locally as this consumer commits."""
        for tp in consumer.assignment():
            highwater = consumer.highwater(tp)
            key = TopicPartition(tp.topic, tp.partition)
            if self._committed.get(key) is None:
                try:
                    committed = await consumer.committed(tp)
                    if committed is None:  # the group never committed here: where it started
                        committed = (
                            (await consumer.beginning_offsets([tp]))[tp]
                            if self._auto_offset_reset == "earliest"
                            else await consumer.position(tp)
                        )
                    self._committed[key] = committed
                except KafkaError:
                    continue
            committed = self._committed[key]
            if highwater is None or committed is None:
                continue
            CONSUMER_LAG.labels(self._group_id, tp.topic, str(tp.partition)).set(
                max(0, highwater - committed)
            )

    async def stop(self) -> None:
        if self._consumer is not None:
            consumer, self._consumer = self._consumer, None
            await consumer.stop()


async def ensure_topics(
    bootstrap: str, topics: Iterable[str] | None = None, partitions: int = 3, *, auth: KafkaAuth = PLAINTEXT
) -> None:
    """Create ``topics`` (default: every Forge topic) if missing."""
    names = list(topics if topics is not None else TOPICS.values())
    admin = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap, request_timeout_ms=10_000, **auth.client_options()
    )
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [NewTopic(name, partitions, 1) for name in names if name not in existing]
        if missing:
            with contextlib.suppress(TopicAlreadyExistsError):
                await admin.create_topics(missing)
    finally:
        await admin.close()
