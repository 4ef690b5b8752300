"""The idempotent Kafka consumer: each event applied exactly once to the consumer's database.

:class:`EventConsumer` applies each event and records its id in ``forge_processed_events`` in
one database transaction, then commits the Kafka offset — a crash between the two replays the
record, and the recorded id turns the replay into a no-op. Records are authenticated first
(:mod:`forge_kit.eventauth`): a consumer drops and counts any record whose signature does not
verify or whose producer does not own the topic (:data:`forge_kit.events.OWNERS`, or ``sources``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence

import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError
from google.protobuf.message import Message
from sqlalchemy.ext.asyncio import AsyncSession

from forge_kit.backoff import Backoff
from forge_kit.db import Database
from forge_kit.eventauth import (
    HEADER_ID,
    HEADER_TYPE,
    PLAINTEXT,
    EventVerifier,
    KafkaAuth,
    Rejected,
    record_rejection,
)
from forge_kit.events import (
    CONSUMER_LAG,
    EVENTS_CONSUMED,
    TOPIC_OWNERS,
    DeadLetter,
    ProcessedEvent,
    decode_event,
)

log = structlog.get_logger(__name__)

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
