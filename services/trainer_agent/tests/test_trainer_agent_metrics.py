"""Training metrics follow the run's metrics.jsonl into the outbox (TrainingMetrics events) and
Prometheus while the run lives, each step once, partial lines left for the next read."""

from __future__ import annotations

import asyncio
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
from forge_trainer_agent.service import RUNNING, AgentService
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


def _streaming_agent(db: Database, store: RunStore, node: NodeInfo, tmp_path: Path) -> AgentService:
    """An agent running jobs as local processes, following their metrics every 50 ms."""
    return AgentService(
        store,
        LocalProcessRunner(),
        node,
        runs_dir=tmp_path / "runs",
        metrics=MetricsStreamer(db, producer="trainer_agent", interval_s=0.05),
    )


async def _ended_with(agent: AgentService, db: Database, count: int) -> None:
    """Wait until the agent runs no job and ``count`` metrics events are staged."""

    async def done() -> bool:
        return len(await staged(db)) == count and not agent.running_job_ids()

    await eventually(done, what=f"the job to end with its {count} metrics staged")


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
    agent = _streaming_agent(db, store, node, tmp_path)
    lines = [json.dumps({"step": s, "loss": 6.0 - s, "tokens_per_s": 1000.0 + s}) for s in (1, 2, 3)]
    script = (
        "import os, time, pathlib\n"
        "p = pathlib.Path(os.environ['FORGE_RUN_DIR']) / 'metrics.jsonl'\n"
        f"for line in {lines!r}:\n"
        "    with p.open('a') as f: f.write(line + '\\n')\n"
        "    time.sleep(0.2)\n"
    )
    await agent.start_job(start_job("job-m", [sys.executable, "-c", script]))

    await _ended_with(agent, db, 3)
    events = await staged(db)
    assert [(e.job_id, e.step, e.values["loss"]) for e in events] == [
        ("job-m", 1, 5.0),
        ("job-m", 2, 4.0),
        ("job-m", 3, 3.0),
    ]
    assert all(e.run_id.startswith("run-") for e in events)
    await agent.shutdown(grace_s=0)
    assert ("job-m", "loss") not in TRAINING_METRIC._metrics  # series dropped when the run ended


async def test_lines_written_before_the_job_is_marked_running_are_published(
    db: Database, store: RunStore, node: NodeInfo, start_job, tmp_path: Path
) -> None:
    """The process starts before the agent records it as running (a database write, slow under
    load); what it writes meanwhile belongs to this attempt and is published too."""

    class SlowStore:
        def __init__(self, inner: RunStore) -> None:
            self._inner = inner

        def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
            return getattr(self._inner, name)

        async def update(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            if kwargs.get("state") == RUNNING:
                await asyncio.sleep(1.5)  # the process writes its first line meanwhile
            return await self._inner.update(*args, **kwargs)

    agent = _streaming_agent(db, SlowStore(store), node, tmp_path)  # type: ignore[arg-type]
    script = (
        "import os, time, pathlib\n"
        "p = pathlib.Path(os.environ['FORGE_RUN_DIR']) / 'metrics.jsonl'\n"
        'p.write_text(\'{"step": 1, "loss": 5.0}\\n\')\n'
        "time.sleep(3)\n"
        "with p.open('a') as f: f.write('{\"step\": 2, \"loss\": 4.0}\\n')\n"
    )
    await agent.start_job(start_job("job-early", [sys.executable, "-c", script]))

    await _ended_with(agent, db, 2)
    assert [(e.step, e.values["loss"]) for e in await staged(db)] == [(1, 5.0), (2, 4.0)]
    await agent.shutdown(grace_s=0)


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
