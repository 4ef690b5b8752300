"""Preference ingest end to end, across a broker restart (see README.md for the thresholds).

    python load/feedback/bench_ingest.py [--preferences 3000] [--raters 24] [--overlap 3]
        [--restart-at 0.5] [--database-url URL] [--out FILE.json]

Starts the real Tansu broker and the real ``preference_feedback`` process (SQLite in a
temporary folder unless ``--database-url``), logs ``--raters`` accounts in through the JSON HTTP
API and has each post preferences as fast as the service answers (next comparison → answer, a
failed post retried with the same answer). When ``--restart-at`` of the preferences are in, the
broker is stopped and started again in place (memory storage: it comes back empty). A consumer
counts ``PreferenceRecorded`` events by preference id on the topic the whole time.

Counted end to end: preferences acknowledged to clients, rows in the database, events on Kafka
(distinct, duplicates), events the restart took from the broker before the consumer read them
and that the consumer then replays from the owner's outbox over its EventLogService (the
catch-up path of the architecture's reliability rules), and what is missing from every path (``lost``, must be 0).
Prints one JSON line with ``"pass": true|false`` and exits 1 on a miss.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError
from forge.events.v1 import events_pb2, events_pb2_grpc

from forge_kit.db import Database
from forge_kit.events import OutboxEvent, ensure_topics, topic_for
from forge_kit.grpckit import make_channel
from forge_kit.testing.processes import ServiceProcess, TansuBroker
from forge_preference_feedback.seeds import read_hh_rlhf, resolve_data_path
from forge_preference_feedback.service import FeedbackService
from forge_preference_feedback.store import PreferenceRow

TARGET_PER_S = 500.0
AUTH_TOKEN = "bench-feedback-token"
PASSWORD = "bench-password-123"
TOPIC = topic_for(events_pb2.PreferenceRecorded())
MIGRATIONS = (
    Path(__file__).resolve().parents[2]
    / "services/preference_feedback/src/forge_preference_feedback/migrations"
)


class Tally:
    """What the clients and the consumer saw."""

    def __init__(self) -> None:
        self.acked: dict[tuple[str, str], str] = {}  # (rater, comparison) -> preference id
        self.retries = 0
        self.kafka: Counter[str] = Counter()
        self.broker_down = asyncio.Event()


async def prepare(url: str, comparisons: int, raters: int) -> None:
    """Seed real HH-RLHF comparisons and rater accounts into the service's database."""
    db = Database(url)
    try:
        await db.migrate(MIGRATIONS)
        service = FeedbackService(db)
        source = resolve_data_path("../shared/data/preferences/hh-rlhf")
        await service.seed_comparisons(read_hh_rlhf(source), limit=comparisons, rng_seed=0)
        for r in range(raters):
            await service.create_rater(f"bench{r:03d}", PASSWORD)
    finally:
        await db.dispose()


async def call(
    client: httpx.AsyncClient, tally: Tally, rng: random.Random, method: str, path: str, **kwargs: Any
) -> httpx.Response:
    """One request, retried (bounded, jittered) on a dropped connection, 429 or 5xx; a retried
    POST carries the same answer, so the service records it once."""
    for attempt in range(20):
        try:
            reply = await client.request(method, path, **kwargs)
            if reply.status_code < 500 and reply.status_code != 429:
                reply.raise_for_status()
                return reply
        except httpx.TransportError:
            pass
        tally.retries += 1
        await asyncio.sleep(min(1.0, 0.05 * 2**attempt) * rng.uniform(0.5, 1.5))
    raise RuntimeError(f"{method} {path} failed 20 times")


async def rater(
    client: httpx.AsyncClient, name: str, quota: list[int], tally: Tally, rng: random.Random
) -> None:
    """One rater: log in, then next → answer until the shared quota is used up or no items are left."""
    opened = await call(
        client, tally, rng, "POST", "/api/v1/sessions", json={"rater_id": name, "password": PASSWORD}
    )
    auth = {"Authorization": f"Bearer {opened.json()['token']}"}
    while quota[0] > 0:
        quota[0] -= 1
        item = (await call(client, tally, rng, "GET", "/api/v1/comparisons/next", headers=auth)).json()[
            "comparison"
        ]
        if item is None:
            return
        body = {"comparison_id": item["id"], "choice": rng.choice(["A", "B", "A", "B", "TIE"])}
        posted = await call(client, tally, rng, "POST", "/api/v1/preferences", json=body, headers=auth)
        tally.acked[(name, item["id"])] = posted.json()["preference_id"]


async def consume(bootstrap: str, tally: Tally, stop: asyncio.Event) -> None:
    """Count PreferenceRecorded events by preference id; reconnect across the broker restart."""
    while not stop.is_set():
        consumer = AIOKafkaConsumer(
            TOPIC, bootstrap_servers=bootstrap, auto_offset_reset="earliest", group_id=None
        )
        try:
            await consumer.start()
            while not stop.is_set() and not tally.broker_down.is_set():
                batches = await consumer.getmany(timeout_ms=200)
                for records in batches.values():
                    for record in records:
                        event = events_pb2.PreferenceRecorded.FromString(record.value)
                        tally.kafka[event.preference_id] += 1
        except KafkaError:
            await asyncio.sleep(0.5)
        finally:
            with contextlib.suppress(Exception):
                await consumer.stop()
        while tally.broker_down.is_set() and not stop.is_set():
            await asyncio.sleep(0.1)


async def audit(url: str) -> tuple[set[str], int, dict[str, int]]:
    """The owner's view: preference ids in the database, unpublished outbox rows, and how many
    outbox events each preference id has (the catch-up source for a consumer)."""
    db = Database(url)
    try:
        async with db.session() as session:
            ids = set((await session.scalars(sa.select(PreferenceRow.id))).all())
            pending = int(
                await session.scalar(
                    sa.select(sa.func.count())
                    .select_from(OutboxEvent)
                    .where(OutboxEvent.published_at.is_(None))
                )
                or 0
            )
            payloads = (
                await session.scalars(
                    sa.select(OutboxEvent.payload).where(
                        OutboxEvent.event_type == events_pb2.PreferenceRecorded.DESCRIPTOR.full_name
                    )
                )
            ).all()
        outbox = Counter(events_pb2.PreferenceRecorded.FromString(p).preference_id for p in payloads)
        return ids, pending, dict(outbox)
    finally:
        await db.dispose()


async def catch_up(target: str, token: str) -> Counter[str]:
    """What a consumer catching up from the owner gets: every PreferenceRecorded event in the
    service's outbox, read page by page over its EventLogService (gRPC)."""
    seen: Counter[str] = Counter()
    after = 0
    async with make_channel(target, token=token) as channel:
        stub = events_pb2_grpc.EventLogServiceStub(channel)
        while True:
            page = await stub.ListEvents(
                events_pb2.ListEventsRequest(after_sequence=after, limit=500, topics=[TOPIC]), timeout=30
            )
            for record in page.events:
                seen[events_pb2.PreferenceRecorded.FromString(record.payload).preference_id] += 1
            after = page.last_sequence
            if not page.has_more:
                return seen


async def run(args: argparse.Namespace) -> dict[str, Any]:
    # 1. Database with comparisons and raters; broker; the service process.
    work = Path(tempfile.mkdtemp(prefix="forge-bench-feedback-"))
    url = args.database_url or f"sqlite+aiosqlite:///{work / 'preference_feedback.db'}"
    comparisons = -(-args.preferences // args.overlap) + args.raters
    await prepare(url, comparisons, args.raters)
    broker = TansuBroker(log_path=str(work / "tansu.log")).start()
    await ensure_topics(broker.bootstrap, [TOPIC])
    env = {
        "FORGE_PREFERENCE_FEEDBACK_DATA_DIR": str(work),
        "FORGE_PREFERENCE_FEEDBACK_DATABASE_URL": url,
        "FORGE_PREFERENCE_FEEDBACK_KAFKA_BOOTSTRAP": broker.bootstrap,
        "FORGE_PREFERENCE_FEEDBACK_GRPC_PORT": "0",
        "FORGE_PREFERENCE_FEEDBACK_HTTP_PORT": "0",
        "FORGE_PREFERENCE_FEEDBACK_OVERLAP_K": str(args.overlap),
        "FORGE_PREFERENCE_FEEDBACK_LOG_LEVEL": "WARNING",
        "FORGE_PREFERENCE_FEEDBACK_AUTH_TOKEN": AUTH_TOKEN,
    }
    service = ServiceProcess("forge_preference_feedback", env=env, log_path=str(work / "service.log")).start()
    tally, stop = Tally(), asyncio.Event()
    consumer = asyncio.create_task(consume(broker.bootstrap, tally, stop))
    restart_s = 0.0
    try:
        # 2. Raters post as fast as the service answers; the broker restarts part-way.
        quota = [args.preferences]
        limits = httpx.Limits(max_connections=args.raters, max_keepalive_connections=args.raters)
        async with httpx.AsyncClient(base_url=service.http_url, limits=limits, timeout=30) as client:
            started = time.perf_counter()
            workers = [
                asyncio.create_task(rater(client, f"bench{r:03d}", quota, tally, random.Random(r)))
                for r in range(args.raters)
            ]

            async def restart() -> None:
                nonlocal restart_s
                while len(tally.acked) < args.preferences * args.restart_at:
                    await asyncio.sleep(0.02)
                t0 = time.perf_counter()
                tally.broker_down.set()
                broker.stop()
                await asyncio.sleep(1.0)
                broker.start()
                await ensure_topics(broker.bootstrap, [TOPIC])
                tally.broker_down.clear()
                restart_s = time.perf_counter() - t0

            restarter = asyncio.create_task(restart())
            await asyncio.gather(*workers)
            ingest_s = time.perf_counter() - started
            if not restarter.done():
                restarter.cancel()
        # 3. Wait for the outbox to drain and the consumer to catch up.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            ids, pending, outbox = await audit(url)
            if pending == 0 and len(tally.kafka) >= len(ids):
                break
            if pending == 0:
                await asyncio.sleep(2)  # drained; give the consumer a moment, then replay
                break
            await asyncio.sleep(0.5)
        drain_s = time.perf_counter() - started - ingest_s
        # 4. The consumer's catch-up from the owner, for what the restart took from the broker.
        replay = await catch_up(service.grpc_target, AUTH_TOKEN)
    finally:
        stop.set()
        await consumer
        service.stop()
        broker.stop()
    # 5. Count end to end.
    ids, pending, outbox = await audit(url)
    acked = set(tally.acked.values())
    missed_by_consumer = ids - set(tally.kafka)
    replayed = missed_by_consumer & set(replay)
    lost = (acked - ids) | (ids - set(tally.kafka) - replayed)
    duplicated_records = len(tally.acked) - len(acked) + sum(1 for n in outbox.values() if n > 1)
    rate = len(acked) / ingest_s if ingest_s else 0.0
    result = {
        "bench": "feedback_ingest",
        "preferences_acked": len(acked),
        "db_records": len(ids),
        "kafka_distinct": len(tally.kafka),
        "kafka_redeliveries": sum(n - 1 for n in tally.kafka.values()),
        "missed_by_consumer_in_restart": len(missed_by_consumer),
        "replayed_from_outbox": len(replayed),
        "outbox_pending": pending,
        "lost": len(lost),
        "duplicated_records": duplicated_records,
        "client_retries": tally.retries,
        "ingest_s": round(ingest_s, 2),
        "drain_s": round(drain_s, 2),
        "broker_restart_s": round(restart_s, 2),
        "preferences_per_s": round(rate, 1),
        "target_per_s": TARGET_PER_S,
        "raters": args.raters,
        "database": url.split(":", 1)[0],
    }
    result["pass"] = bool(
        rate >= TARGET_PER_S
        and len(lost) == 0
        and duplicated_records == 0
        and pending == 0
        and len(ids) == len(acked) == args.preferences
        and restart_s > 0
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preferences", type=int, default=3000)
    parser.add_argument("--raters", type=int, default=24)
    parser.add_argument("--overlap", type=int, default=3)
    parser.add_argument("--restart-at", type=float, default=0.5)
    parser.add_argument("--database-url", default="")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    for name in ("preferences", "raters", "overlap"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if not 0.0 < args.restart_at < 1.0:
        parser.error("--restart-at must be between 0 and 1")
    result = asyncio.run(run(args))
    line = json.dumps(result, sort_keys=True)
    print(line)
    if args.out:
        args.out.write_text(line + "\n")
    sys.exit(0 if result["pass"] else 1)


if __name__ == "__main__":
    main()
