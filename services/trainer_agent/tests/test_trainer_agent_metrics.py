"""Training metrics follow the run's metrics.jsonl into the outbox (TrainingMetrics events) and
Prometheus while the run lives, each step once, partial lines left for the next read."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
from forge.events.v1 import events_pb2

from forge_kit.db import Database
from forge_kit.events import OutboxEvent
from forge_kit.testing import eventually
from forge_trainer_agent.metrics import TRAINING_METRIC, MetricsStreamer, _Cursor, read_new_records
from forge_trainer_agent.node import NodeInfo
from forge_trainer_agent.runner import LocalProcessRunner
from forge_trainer_agent.service import AgentService
from forge_trainer_agent.store import RunStore

pytestmark = pytest.mark.asyncio


async def staged(db: Database) -> list[events_pb2.TrainingMetrics]:
    async with db.session() as session:
        rows = (await session.scalars(sa.select(OutboxEvent).order_by(OutboxEvent.sequence))).all()
    return [
        events_pb2.TrainingMetrics.FromString(r.payload)
        for r in rows
        if r.topic == "forge.trainer.training_metrics.v1"
    ]


async def test_partial_lines_wait_and_bad_lines_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 5.0}\nnot json\n{"step": 2, "loss": 4.5, "lr"')
    cursor = _Cursor()
    assert read_new_records(path, cursor) == [{"step": 1.0, "loss": 5.0}]
    with path.open("a") as handle:
        handle.write(': 0.001, "note": "x", "nan": NaN}\n')
    assert read_new_records(path, cursor) == [{"step": 2.0, "loss": 4.5, "lr": 0.001}]
    assert read_new_records(path, cursor) == []


async def test_a_running_jobs_metrics_become_events_and_gauges(
    db: Database, store: RunStore, node: NodeInfo, start_job, tmp_path: Path
) -> None:
    agent = AgentService(
        store,
        LocalProcessRunner(),
        node,
        runs_dir=tmp_path / "runs",
        metrics=MetricsStreamer(db, producer="trainer_agent", interval_s=0.05),
    )
    lines = [json.dumps({"step": s, "loss": 6.0 - s, "tokens_per_s": 1000.0 + s}) for s in (1, 2, 3)]
    script = (
        "import os, time, pathlib\n"
        "p = pathlib.Path(os.environ['FORGE_RUN_DIR']) / 'metrics.jsonl'\n"
        f"for line in {lines!r}:\n"
        "    with p.open('a') as f: f.write(line + '\\n')\n"
        "    time.sleep(0.2)\n"
    )
    await agent.start_job(start_job("job-m", [sys.executable, "-c", script]))

    async def done() -> bool:
        return len(await staged(db)) == 3 and not agent.running_job_ids()

    await eventually(done, what="the job to end with its 3 metrics staged")
    events = await staged(db)
    assert [(e.job_id, e.step, e.values["loss"]) for e in events] == [
        ("job-m", 1, 5.0),
        ("job-m", 2, 4.0),
        ("job-m", 3, 3.0),
    ]
    assert all(e.run_id.startswith("run-") for e in events)
    await agent.shutdown(grace_s=0)
    assert ("job-m", "loss") not in TRAINING_METRIC._metrics  # series dropped when the run ended


async def test_an_eval_line_read_apart_from_its_steps_log_line_is_still_published(
    db: Database, tmp_path: Path
) -> None:
    """The loop logs step N, evaluates, then writes step N's ``val_loss`` on a line of its own: a
    poll between the two must not drop the eval line as a replay of step N (a sweep following
    ``val_loss`` would never see it)."""
    path = tmp_path / "metrics.jsonl"
    streamer = MetricsStreamer(db, producer="trainer_agent")
    cursor = _Cursor()
    path.write_text('{"step": 50, "loss": 4.0}\n')
    assert await streamer.publish_new("job-e", "run-e", path, cursor) == 1
    with path.open("a") as handle:
        handle.write('{"step": 50, "val_loss": 4.2}\n')
    assert await streamer.publish_new("job-e", "run-e", path, cursor) == 1
    # The same step and names again (a replay), or an earlier step: not published twice.
    with path.open("a") as handle:
        handle.write('{"step": 50, "val_loss": 4.2}\n{"step": 49, "loss": 4.1}\n{"step": 51, "loss": 3.9}\n')
    assert await streamer.publish_new("job-e", "run-e", path, cursor) == 1
    events = await staged(db)
    assert [(e.step, sorted(e.values)) for e in events] == [
        (50, ["loss"]),
        (50, ["val_loss"]),
        (51, ["loss"]),
    ]
