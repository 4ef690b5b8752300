"""Catching up from the owner: the producer's outbox served over gRPC, and a consumer-side loop
that applies whatever the broker never delivered.

Kafka carries notifications; the owning service's database is the source of truth. The local
broker keeps nothing across a restart, so an event published but not yet consumed when it
restarts would be gone. Every producer therefore serves ``forge.events.v1.EventLogService``
from its outbox (:class:`EventLogApi`, registered by ``ServiceApp`` whenever the outbox is on),
and a consumer that must see everything runs :class:`CatchUp` next to its Kafka loop:

1. for each source (producer), read the events after its watermark, page by page, in order;
2. apply each through the consumer's own path — same signature check and producer rule, same
   handler, same dedupe on event id, same dead-lettering — so an event seen on Kafka and again
   here is applied once, and a source that serves forged rows gets none of them applied (the
   producer signs each row as it serves it, exactly as its relay signs it for Kafka);
3. store the new watermark (``forge_catchup_watermarks``) in the database;
4. sleep until the next round.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc
import sqlalchemy as sa
import structlog
from forge.events.v1 import events_pb2, events_pb2_grpc
from sqlalchemy.orm import Mapped, mapped_column

from forge_kit import errors
from forge_kit.consumer import EventConsumer
from forge_kit.db import Base, Database
from forge_kit.eventauth import HEADER_KEY_ID, HEADER_SIGNATURE, EventSigner
from forge_kit.events import HEADER_ID, HEADER_PRODUCER, HEADER_TYPE, OutboxEvent
from forge_kit.grpckit import make_channel

log = structlog.get_logger(__name__)

SERVICE_NAME = events_pb2.DESCRIPTOR.services_by_name["EventLogService"].full_name


class EventLogApi(events_pb2_grpc.EventLogServiceServicer):
    """``ListEvents`` over this service's outbox table; ``signer`` signs each row served (without
    one, rows go out unsigned and every consumer drops them)."""

    def __init__(
        self, db: Database, *, signer: EventSigner | None, default_page: int = 200, max_page: int = 1000
    ) -> None:
        self._db = db
        self._signer = signer
        self._default_page = default_page
        self._max_page = max_page

    async def ListEvents(
        self, request: events_pb2.ListEventsRequest, context: grpc.aio.ServicerContext
    ) -> events_pb2.ListEventsResponse:
        if request.limit > self._max_page:
            raise errors.ValidationError("limit", f"must be at most {self._max_page}")
        limit = request.limit or self._default_page
        query = sa.select(OutboxEvent).where(OutboxEvent.sequence > request.after_sequence)
        async with self._db.session() as session:
            # Read one row past the page (on any topic) to learn whether more follow.
            rows = (await session.scalars(query.order_by(OutboxEvent.sequence).limit(limit + 1))).all()
        has_more = len(rows) > limit
        rows = rows[:limit]
        topics = set(request.topics)
        return events_pb2.ListEventsResponse(
            events=[self._record(row) for row in rows if not topics or row.topic in topics],
            last_sequence=rows[-1].sequence if rows else request.after_sequence,
            has_more=has_more,
        )

    def _record(self, row: OutboxEvent) -> events_pb2.EventRecord:
        record = events_pb2.EventRecord(
            sequence=row.sequence,
            event_id=row.event_id,
            topic=row.topic,
            event_type=row.event_type,
            payload=row.payload,
            key=(row.key or b"").decode(errors="replace"),
        )
        if self._signer is not None:
            record.producer = self._signer.producer
            record.key_id = self._signer.key_id
            record.signature = self._signer.sign(
                topic=row.topic, event_type=row.event_type, event_id=row.event_id, payload=row.payload
            )
        return record


class CatchUpWatermark(Base):
    """How far a consumer group has read a producer's outbox."""

    __tablename__ = "forge_catchup_watermarks"

    consumer_group: Mapped[str] = mapped_column(sa.String(255), primary_key=True)
    producer: Mapped[str] = mapped_column(sa.String(255), primary_key=True)
    sequence: Mapped[int] = mapped_column(sa.BigInteger, default=0)


@dataclass(frozen=True)
class CatchUpSource:
    """A producer to catch up from: its name, gRPC address and the token its API wants."""

    producer: str
    target: str
    token: str


@dataclass
class _Replayed:
    """The fields of a Kafka record :meth:`EventConsumer.handle` reads, for an outbox row."""

    topic: str
    value: bytes
    offset: int
    partition: int = -1
    headers: list[tuple[str, bytes]] = field(default_factory=list)


class CatchUp:
    """Applies, through ``consumer``, every event of ``sources`` on ``topics`` it has not seen;
    ``discover``, when given, names more sources at each round (producers that come and go, such
    as one trainer agent per node)."""

    def __init__(
        self,
        consumer: EventConsumer,
        db: Database,
        *,
        group_id: str,
        topics: Sequence[str],
        sources: Sequence[CatchUpSource],
        interval_s: float = 30.0,
        page_size: int = 200,
        rpc_timeout_s: float = 10.0,
        discover: Callable[[], Awaitable[Sequence[CatchUpSource]]] | None = None,
    ) -> None:
        self._consumer = consumer
        self._db = db
        self._group_id = group_id
        self._topics = list(topics)
        self._sources = list(sources)
        self._interval_s = interval_s
        self._page_size = page_size
        self._rpc_timeout_s = rpc_timeout_s
        self._discover = discover

    async def _watermark(self, producer: str) -> int:
        async with self._db.session() as session:
            row = await session.get(CatchUpWatermark, (self._group_id, producer))
        return row.sequence if row else 0

    async def _save(self, producer: str, sequence: int) -> None:
        async with self._db.session() as session:
            row = await session.get(CatchUpWatermark, (self._group_id, producer))
            if row is None:
                session.add(
                    CatchUpWatermark(consumer_group=self._group_id, producer=producer, sequence=sequence)
                )
            else:
                row.sequence = max(row.sequence, sequence)

    async def catch_up(self, source: CatchUpSource) -> int:
        """Read ``source`` from the watermark to its end; returns how many events were new here."""
        applied = 0
        after = await self._watermark(source.producer)
        async with make_channel(source.target, token=source.token) as channel:
            stub = events_pb2_grpc.EventLogServiceStub(channel)
            while True:
                page = await stub.ListEvents(
                    events_pb2.ListEventsRequest(
                        after_sequence=after, limit=self._page_size, topics=self._topics
                    ),
                    timeout=self._rpc_timeout_s,
                )
                for record in page.events:
                    replayed = _Replayed(
                        topic=record.topic,
                        value=record.payload,
                        offset=record.sequence,
                        headers=[
                            (HEADER_TYPE, record.event_type.encode()),
                            (HEADER_ID, record.event_id.encode()),
                            (HEADER_PRODUCER, record.producer.encode()),
                            (HEADER_KEY_ID, record.key_id.encode()),
                            (HEADER_SIGNATURE, record.signature.encode()),
                        ],
                    )
                    if await self._consumer.handle(replayed):  # type: ignore[arg-type]
                        applied += 1
                if page.last_sequence > after:
                    after = page.last_sequence
                    await self._save(source.producer, after)
                if not page.has_more:
                    return applied

    async def run_once(self) -> int:
        """One round over every source; a source that is down is skipped until the next round."""
        applied = 0
        sources = list(self._sources)
        if self._discover is not None:
            try:
                sources += await self._discover()
            except grpc.aio.AioRpcError as exc:
                log.warning("catchup.discovery_unavailable", group=self._group_id, error=exc.code().name)
        for source in sources:
            try:
                applied += await self.catch_up(source)
            except grpc.aio.AioRpcError as exc:
                log.warning("catchup.source_unavailable", producer=source.producer, error=exc.code().name)
        if applied:
            log.info("catchup.applied", group=self._group_id, events=applied)
        return applied

    async def run(self) -> None:
        """Catch up at start, then every ``interval_s`` (jittered so replicas do not align)."""
        while True:
            await self.run_once()
            await asyncio.sleep(self._interval_s * random.uniform(0.8, 1.2))
