"""Kafka events: topics, envelopes, the outbox table and staging, and a producer.

Every payload is a ``forge.events.v1`` message whose first field is ``EventMeta meta`` (event id,
time, producer, outbox sequence). On the wire a record's value is the serialised message; its
headers carry ``forge-event-type`` (the message's full name), ``forge-event-id`` and
``forge-producer`` so a consumer can decode and dedupe without guessing, and ``forge-key-id`` and
``forge-signature`` (:mod:`forge_kit.eventauth`): a consumer drops and counts any record whose
signature does not verify or whose producer does not own the topic (:data:`OWNERS`, or ``sources``).

Delivery is at least once end to end:

* a service that changes its database stages the event in the same transaction
  (:func:`stage_event`, or :func:`stage_event_sync` on a synchronous connection), and
  :class:`forge_kit.outbox.OutboxRelay` publishes staged rows in sequence order, retrying with
  capped, jittered backoff while the broker is away — nothing is lost;
* :class:`forge_kit.consumer.EventConsumer` applies each event and records its id in
  ``forge_processed_events`` in one database transaction, then commits the Kafka offset — a crash
  between the two replays the record, and the recorded id turns the replay into a no-op.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import uuid
from collections import Counter as Tally
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import sqlalchemy as sa
import structlog
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError
from forge.events.v1 import events_pb2
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.message import Message
from prometheus_client import Counter, Gauge
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Mapped, mapped_column

from forge_kit.db import Base, utcnow
from forge_kit.eventauth import HEADER_ID as HEADER_ID
from forge_kit.eventauth import HEADER_PRODUCER as HEADER_PRODUCER
from forge_kit.eventauth import HEADER_TYPE as HEADER_TYPE
from forge_kit.eventauth import (
    PLAINTEXT,
    EventSigner,
    KafkaAuth,
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


class SyncConnection(Protocol):
    """What :func:`stage_event_sync` writes through: SQLAlchemy's ``Connection``, or a wrapper
    that runs some statements its own way (a service's precompiled hot path)."""

    def execute(self, statement: sa.Executable, parameters: dict[str, Any] | None = None, /) -> Any: ...


OUTBOX = cast(sa.Table, OutboxEvent.__table__)
#: The statements :func:`stage_event_sync` runs, built once: a caller that precompiles its hot
#: path's statements includes these.
INSERT_OUTBOX_EVENT = sa.insert(OUTBOX).returning(OUTBOX.c.sequence)
SET_OUTBOX_PAYLOAD = (
    sa.update(OUTBOX).where(OUTBOX.c.sequence == sa.bindparam("seq")).values(payload=sa.bindparam("body"))
)


def stage_event_sync(conn: SyncConnection, message: Message, *, producer: str, key: str = "") -> Message:
    """:func:`stage_event` on a synchronous connection: the event goes into the outbox in the
    caller's transaction, its ``meta`` naming the outbox row."""
    event_id = str(uuid.uuid4())
    sequence = conn.execute(
        INSERT_OUTBOX_EVENT,
        {
            "event_id": event_id,
            "topic": topic_for(message),
            "key": key.encode() if key else None,
            "event_type": message.DESCRIPTOR.full_name,
            "payload": b"",
            "created_at": utcnow(),
        },
    ).scalar_one()
    meta = new_meta(producer, sequence=sequence)
    meta.event_id = event_id
    message.meta.CopyFrom(meta)  # type: ignore[attr-defined]
    conn.execute(SET_OUTBOX_PAYLOAD, {"seq": sequence, "body": message.SerializeToString()})
    return message


@dataclass(frozen=True)
class Record:
    """One record on its way to Kafka."""

    topic: str
    value: bytes
    key: bytes | None
    headers: list[tuple[str, bytes]]


class Publisher(Protocol):
    """Sends records to Kafka: :class:`forge_kit.outbox.OutboxRelay` and direct publishers."""

    async def send(
        self, topic: str, value: bytes, *, key: bytes | None, headers: list[tuple[str, bytes]]
    ) -> None:
        """Send and wait for the broker's acknowledgement; raise on failure."""

    async def send_batch(self, records: Sequence[Record]) -> tuple[int, Exception | None]:
        """Send ``records`` in order, then wait for the acknowledgements; returns how many from
        the start were acknowledged and the error that stopped the rest (None when all were)."""


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

    async def send_batch(self, records: Sequence[Record]) -> tuple[int, Exception | None]:
        acked = 0
        try:
            producer = await self._ensure()
            # Appended to the producer's per-partition batches in this order before any is awaited.
            pending = [await producer.send(r.topic, r.value, key=r.key, headers=r.headers) for r in records]
            for future in pending:
                await future
                acked += 1
        except KafkaError as exc:
            # A producer that lost the broker may stay wedged; rebuild it on the next attempt.
            await self.close()
            return acked, exc
        finally:
            for topic, n in Tally(r.topic for r in records[:acked]).items():
                EVENTS_PUBLISHED.labels(topic).inc(n)
        return acked, None

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
