"""Preference ingest end to end, across a broker restart (see README.md for the thresholds).

    python load/feedback/bench_ingest.py [--preferences 3000] [--raters 24] [--overlap 3]
        [--restart-at 0.5] [--database-url URL] [--separate-next] [--out FILE.json]

Starts the real Tansu broker and the real ``preference_feedback`` process (SQLite in a
temporary folder unless ``--database-url``), logs ``--raters`` accounts in through the JSON HTTP
API (before the clock starts) and has each post preferences as fast as the service answers
over one kept-alive aiohttp connection (each answer's post asks for the rater's next item in its
reply, as a rating front end does; ``--separate-next`` fetches it with its own GET instead), a
failed post retried with the same answer. When ``--restart-at`` of the preferences are in, the broker is stopped and
started again in place, on a thread so the raters keep going (memory storage: it comes back
empty). A consumer counts ``PreferenceRecorded`` events by preference id on the topic the
whole time. The rate onto Kafka is read from the outbox rows' ``published_at``.

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
import datetime as dt
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import sqlalchemy as sa
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError
from forge.events.v1 import events_pb2, events_pb2_grpc

from forge_kit.backoff import Backoff
from forge_kit.db import Database, utcnow
from forge_kit.events import OutboxEvent, ensure_topics, topic_for
from forge_kit.grpckit import make_channel
from forge_kit.paths import resolve_data_path
from forge_kit.testing import eventkeys
from forge_kit.testing.processes import ServiceProcess, TansuBroker, cpu_seconds
from forge_preference_feedback.seeds import read_hh_rlhf
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
        self.retries: Counter[str] = Counter()  # why requests were retried
        self.kafka: Counter[str] = Counter()
        self.broker_down = asyncio.Event()


async def prepare(url: str, comparisons: int, raters: int) -> None:
    """Seed real HH-RLHF comparisons and rater accounts into the service's database."""
    db = Database(url)
    try:
        await db.migrate(MIGRATIONS)
        service = FeedbackService(db)
        source = resolve_data_path("preferences/hh-rlhf")
        await service.seed_comparisons(read_hh_rlhf(source), limit=comparisons, rng_seed=0)
        for r in range(raters):
            await service.create_rater(f"bench{r:03d}", PASSWORD)
    finally:
        await db.dispose()


class Failed(Exception):
    """A request that gave up after its bounded retries."""


async def call(
    client: aiohttp.ClientSession, tally: Tally, rng: random.Random, method: str, path: str, **kwargs: Any
) -> Any:
    """One request, retried (bounded, jittered) on a dropped connection, 429 or 5xx; a retried
    POST carries the same answer, so the service records it once. Returns the JSON body."""
    backoff = Backoff(0.05, 1.0, jitter=(0.5, 1.5), rng=rng)
    for _ in range(20):
        try:
            async with client.request(method, path, **kwargs) as reply:
                if reply.status < 500 and reply.status != 429:
                    body = await reply.json()
                    if reply.status >= 400:
                        raise Failed(f"{method} {path}: {reply.status} {body}")
                    return body
                reason = f"http {reply.status}"
        except aiohttp.ClientError as exc:
            reason = f"{type(exc).__name__}: {exc}"[:120]
        tally.retries[reason] += 1
        await backoff.sleep()
    raise Failed(f"{method} {path} failed 20 times")


async def log_in(client: aiohttp.ClientSession, name: str, tally: Tally, rng: random.Random) -> str:
    """A rater's bearer token (``POST /api/v1/sessions``)."""
    opened = await call(
        client, tally, rng, "POST", "/api/v1/sessions", json={"rater_id": name, "password": PASSWORD}
    )
    return str(opened["token"])


async def rater(
    client: aiohttp.ClientSession,
    name: str,
    token: str,
    quota: list[int],
    tally: Tally,
    rng: random.Random,
    *,
    separate_next: bool,
) -> None:
    """One logged-in rater answers until the shared quota is used up or no items are left: each
    answer's post asks for the next item too (``"next": true``, one round trip per item), or
    with ``separate_next`` the item comes from its own ``GET /api/v1/comparisons/next``."""
    auth = {"Authorization": f"Bearer {token}"}
    item: dict[str, Any] | None = None
    while quota[0] > 0:
        quota[0] -= 1
        if item is None:
            item = (await call(client, tally, rng, "GET", "/api/v1/comparisons/next", headers=auth))[
                "comparison"
            ]
            if item is None:
                return
        more = not separate_next and quota[0] > 0
        body = {"comparison_id": item["id"], "choice": rng.choice(["A", "B", "A", "B", "TIE"]), "next": more}
        posted = await call(client, tally, rng, "POST", "/api/v1/preferences", json=body, headers=auth)
        tally.acked[(name, item["id"])] = posted["preference_id"]
        item = posted["next"]["comparison"] if more else None


def mean_of(metrics: str, histogram: str) -> float:
    """Mean of a Prometheus histogram in a /metrics page (NaN when it has no samples)."""
    values = {}
    for line in metrics.splitlines():
        name, _, value = line.partition(" ")
        if name in (f"{histogram}_sum", f"{histogram}_count"):
            values[name] = float(value)
    count = values.get(f"{histogram}_count", 0.0)
    return values.get(f"{histogram}_sum", 0.0) / count if count else float("nan")


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


async def audit(url: str, overlap: int) -> tuple[set[str], int, dict[str, int], dt.datetime | None, int]:
    """The owner's view: preference ids in the database, unpublished outbox rows, how many
    outbox events each preference id has (the catch-up source for a consumer), when the
    broker acknowledged the last of them, and how many comparisons got more than ``overlap``
    answers (concurrent assignment handing one item to too many raters)."""
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
            last_published = await session.scalar(sa.select(sa.func.max(OutboxEvent.published_at)))
            payloads = (
                await session.scalars(
                    sa.select(OutboxEvent.payload).where(
                        OutboxEvent.event_type == events_pb2.PreferenceRecorded.DESCRIPTOR.full_name
                    )
                )
            ).all()
            per_item = (
                sa.select(sa.func.count().label("n"))
                .select_from(PreferenceRow)
                .group_by(PreferenceRow.comparison_id)
                .subquery()
            )
            over = int(
                await session.scalar(
                    sa.select(sa.func.count()).select_from(per_item).where(per_item.c.n > overlap)
                )
                or 0
            )
        outbox = Counter(events_pb2.PreferenceRecorded.FromString(p).preference_id for p in payloads)
        return ids, pending, dict(outbox), last_published, over
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
        **eventkeys.service_env("preference_feedback"),
        "FORGE_PREFERENCE_FEEDBACK_GROUP_COMMIT": "false" if args.no_group_commit else "true",
    }
    try:
        service = ServiceProcess(
            "forge_preference_feedback", env=env, log_path=str(work / "service.log")
        ).start()
    except BaseException:
        broker.stop()  # leave nothing running when the service does not come up
        raise
    tally, stop = Tally(), asyncio.Event()
    consumer = asyncio.create_task(consume(broker.bootstrap, tally, stop))
    restart_s, group_commit, service_cpu = 0.0, float("nan"), 0.0
    down = [0.0, 0.0]  # when the broker process was gone, in seconds from the first request
    try:
        # 2. Raters post as fast as the service answers; the broker restarts part-way.
        quota = [args.preferences]
        # aiohttp, one kept-alive connection per rater: httpx's async client tops out near 400
        # requests/s on one core here, which would make the bench its own bottleneck.
        connector = aiohttp.TCPConnector(limit=args.raters)
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(service.http_url, connector=connector, timeout=timeout) as client:
            # Logins first (Argon2 is slow by design, and a session lasts hours): the clock
            # measures the sustained rate of preferences.
            names = [f"bench{r:03d}" for r in range(args.raters)]
            tokens = await asyncio.gather(*(log_in(client, n, tally, random.Random(n)) for n in names))
            started, started_at = time.perf_counter(), utcnow()
            service_cpu = cpu_seconds(service.pid)
            workers = [
                asyncio.create_task(
                    rater(
                        client, name, token, quota, tally, random.Random(r), separate_next=args.separate_next
                    )
                )
                for r, (name, token) in enumerate(zip(names, tokens, strict=True))
            ]

            async def restart() -> None:
                nonlocal restart_s
                while len(tally.acked) < args.preferences * args.restart_at:
                    await asyncio.sleep(0.02)
                t0 = time.perf_counter()
                tally.broker_down.set()
                # On threads: stop() and start() block until the process is gone / listening
                # (about 5 s for start), and the raters share this event loop.
                await asyncio.to_thread(broker.stop)
                down[0] = time.perf_counter() - started
                await asyncio.sleep(1.0)
                await asyncio.to_thread(broker.start)
                down[1] = time.perf_counter() - started
                await ensure_topics(broker.bootstrap, [TOPIC])
                tally.broker_down.clear()
                restart_s = time.perf_counter() - t0

            restarter = asyncio.create_task(restart())
            await asyncio.gather(*workers)
            ingest_s = time.perf_counter() - started
            service_cpu = cpu_seconds(service.pid) - service_cpu
            async with client.get("/metrics") as reply:
                group_commit = mean_of(await reply.text(), "forge_feedback_group_commit_units")
            # A short run can end while the broker is still coming back: the outbox holds the
            # events until it is, and the clock for "onto Kafka" keeps running.
            await restarter
        # 3. Wait for the outbox to drain (every row acknowledged by the broker).
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            ids, pending, outbox, last_published, _ = await audit(url, args.overlap)
            if pending == 0:
                break
            await asyncio.sleep(0.1)
        drain_s = time.perf_counter() - started - ingest_s
        onto_kafka_s = (last_published - started_at).total_seconds() if last_published else float("nan")
        # The consumer reconnects after the restart on its own schedule; give it up to 15 s to
        # read what is on the topic. What it still lacks then, the restart took.
        while time.monotonic() < deadline and len(tally.kafka) < len(ids):
            await asyncio.sleep(0.2)
            if time.perf_counter() - started - ingest_s - drain_s > 15.0:
                break
        # 4. The consumer's catch-up from the owner, for what the restart took from the broker.
        replay = await catch_up(service.grpc_target, AUTH_TOKEN)
    finally:
        stop.set()
        await consumer
        service.stop()
        broker.stop()
    # 5. Count end to end.
    ids, pending, outbox, _, over_overlap = await audit(url, args.overlap)
    acked = set(tally.acked.values())
    missed_by_consumer = ids - set(tally.kafka)
    replayed = missed_by_consumer & set(replay)
    lost = (acked - ids) | (ids - set(tally.kafka) - replayed)
    duplicated_records = len(tally.acked) - len(acked) + sum(1 for n in outbox.values() if n > 1)
    rate = len(acked) / ingest_s if ingest_s else 0.0
    # Onto Kafka: from the first request until the broker acknowledged the last outbox row,
    # less the part of that time the broker process was down (nothing can be published then).
    outage = max(0.0, min(onto_kafka_s, down[1]) - down[0])
    kafka_rate = len(acked) / (onto_kafka_s - outage) if onto_kafka_s > outage else 0.0
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
        "comparisons_over_overlap": over_overlap,
        "client_retries": sum(tally.retries.values()),
        "client_retry_reasons": dict(tally.retries),
        "ingest_s": round(ingest_s, 2),
        "drain_s": round(drain_s, 2),
        "broker_restart_s": round(restart_s, 2),
        "broker_down_s": round(down[1] - down[0], 2),
        "broker_down_during_publishing_s": round(outage, 2),
        "onto_kafka_s": round(onto_kafka_s, 2),
        "preferences_per_s": round(rate, 1),
        "onto_kafka_per_s": round(kafka_rate, 1),
        "service_cpu_ms_per_preference": round(1000 * service_cpu / max(1, len(acked)), 2),
        "target_per_s": TARGET_PER_S,
        "raters": args.raters,
        "mean_units_per_group_commit": round(group_commit, 1) if group_commit == group_commit else None,
        "database": url.split(":", 1)[0],
        "group_commit": not args.no_group_commit,
        "flow": "separate_next" if args.separate_next else "answer_and_next",
    }
    result["pass"] = bool(
        rate >= TARGET_PER_S
        and kafka_rate >= TARGET_PER_S
        and len(lost) == 0
        and duplicated_records == 0
        and over_overlap == 0
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
    parser.add_argument(
        "--separate-next",
        action="store_true",
        help="fetch each next item with its own GET (two requests per preference) instead of in the answer's reply",
    )
    parser.add_argument(
        "--no-group-commit", action="store_true", help="a transaction per unit (the baseline to compare with)"
    )
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
