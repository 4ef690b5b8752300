"""Training metrics from a run's ``metrics.jsonl`` to Kafka and Prometheus, while it runs.

The training loop (rank 0) appends one JSON object per logged step to
``<run dir>/metrics.jsonl``. :class:`MetricsStreamer` follows that file for every live attempt on
this node: each new complete line becomes one ``TrainingMetrics`` event, staged in the outbox in
one transaction per batch (so Kafka gets each line once, in order, even across a broker restart),
and the latest value of each metric is exported as ``forge_trainer_agent_training_metric``.
A partial last line (the writer is mid-append) is left for the next poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import structlog
from forge.events.v1 import events_pb2
from prometheus_client import Gauge

from forge_kit.db import Database
from forge_kit.events import stage_event

log = structlog.get_logger(__name__)

TRAINING_METRIC = Gauge(
    "forge_trainer_agent_training_metric",
    "Latest value of a training metric of a job running on this node",
    ["job_id", "metric"],
)
METRICS_FILE = "metrics.jsonl"


def attempt_offset(run_dir: Path) -> int:
    """Where an attempt about to start begins in the run's metrics file: its size now (earlier
    attempts' lines were published by them). Taken before the attempt's process starts."""
    path = run_dir / METRICS_FILE
    return path.stat().st_size if path.exists() else 0


@dataclass
class _Cursor:
    offset: int = 0
    last_step: int = -1
    sent_at_last_step: frozenset[str] = frozenset()
    """Names already published at ``last_step`` (the loop writes a step's eval on a line of its own)."""


def read_new_records(path: Path, cursor: _Cursor) -> list[dict[str, float]]:
    """Complete lines after ``cursor.offset`` (advanced past them), as {name: number} with
    ``step``; lines that are not JSON objects with a step are skipped and logged."""
    if not path.exists():
        return []
    with path.open("rb") as handle:
        handle.seek(cursor.offset)
        data = handle.read()
    end = data.rfind(b"\n") + 1
    cursor.offset += end
    records = []
    for raw in data[:end].splitlines():
        try:
            record = json.loads(raw)
        except ValueError:
            log.warning("metrics.bad_line", path=str(path), line=raw[:200])
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), int | float):
            continue
        values = {
            str(k): float(v)
            for k, v in record.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(float(v))
        }
        records.append(values)
    return records


class MetricsStreamer:
    """Follows ``metrics.jsonl`` of each live run and publishes new steps."""

    def __init__(self, db: Database, *, producer: str, interval_s: float = 2.0) -> None:
        self._db = db
        self._producer = producer
        self._interval_s = interval_s

    async def follow(self, job_id: str, run_id: str, run_dir: Path, stop: asyncio.Event, offset: int) -> None:
        """Publish until ``stop`` is set, then once more for what was written last. ``offset``:
        where this attempt's lines start (:func:`attempt_offset`, taken before its process starts:
        what the process writes before this task first runs is its own)."""
        path = run_dir / METRICS_FILE
        cursor = _Cursor(offset=offset)
        try:
            while not stop.is_set():
                await self.publish_new(job_id, run_id, path, cursor)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=self._interval_s)
            await self.publish_new(job_id, run_id, path, cursor)
        finally:
            for metric in list(TRAINING_METRIC._metrics):
                if metric[0] == job_id:
                    TRAINING_METRIC.remove(*metric)

    async def publish_new(self, job_id: str, run_id: str, path: Path, cursor: _Cursor) -> int:
        records = await asyncio.to_thread(read_new_records, path, cursor)
        # Steps before the last one sent, and names already sent at it, are replays (a resumed
        # run writing steps again); other names at the last step are its eval line, written
        # after the step's log line and possibly read by a later poll.
        fresh = []
        last, sent = cursor.last_step, cursor.sent_at_last_step
        for record in records:
            step = int(record.pop("step"))
            names = frozenset(record)
            if step < last or (step == last and names <= sent):
                continue
            sent = sent | names if step == last else names
            last = step
            fresh.append((step, record))
        if not fresh:
            return 0
        async with self._db.session() as session:
            for step, record in fresh:
                event = events_pb2.TrainingMetrics(job_id=job_id, run_id=run_id, step=step, values=record)
                await stage_event(session, event, producer=self._producer, key=job_id)
                for name, value in record.items():
                    TRAINING_METRIC.labels(job_id, name).set(value)
        cursor.last_step, cursor.sent_at_last_step = last, sent
        return len(fresh)
