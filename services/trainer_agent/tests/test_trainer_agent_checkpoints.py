"""A job that publishes checkpoints gets them announced once: the agent runs a real job that
writes checkpoint manifests with the training runtime's CheckpointManager, and on its end stages
``CheckpointPublished`` in the outbox for the newest complete one."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import sqlalchemy as sa
from forge.events.v1 import events_pb2

from forge_kit.db import Database
from forge_kit.events import OutboxEvent
from forge_kit.objectstore import ObjectStore
from forge_kit.testing import eventually
from forge_trainer_agent.checkpoints import CheckpointAnnouncer, ManifestFinder
from forge_trainer_agent.node import NodeInfo
from forge_trainer_agent.runner import LocalProcessRunner
from forge_trainer_agent.service import AgentService
from forge_trainer_agent.store import RunStore

JOB = textwrap.dedent(
    """
    import os, torch
    from forge_kit.objectstore import ObjectStore
    from forge_training.checkpoint import CheckpointManager
    store = ObjectStore(os.environ["FORGE_OBJECTS_URL"])
    manager = CheckpointManager(store, os.environ["FORGE_JOB_ID"], async_save=False)
    for step in (10, 20):
        manager.save(step, {"model": {"w": torch.full((2,), float(step))}}, {"metrics": {"val_loss": 3.0 - step / 10}})
    # A torn checkpoint (files but no manifest) must not be announced.
    store.put_bytes(f"checkpoints/{os.environ['FORGE_JOB_ID']}/step-00000030/rank-00000.pt", b"partial")
    os.makedirs("hf", exist_ok=True)
    open("hf/config.json", "w").write("{}")
    """
)


async def outbox(db: Database) -> list[events_pb2.CheckpointPublished]:
    async with db.session() as session:
        rows = (await session.scalars(sa.select(OutboxEvent).order_by(OutboxEvent.sequence))).all()
    return [
        events_pb2.CheckpointPublished.FromString(r.payload)
        for r in rows
        if r.event_type.endswith("CheckpointPublished")
    ]


async def test_finished_job_announces_its_newest_complete_checkpoint_once(
    db: Database, store: RunStore, node: NodeInfo, tmp_path: Path, start_job
) -> None:  # type: ignore[no-untyped-def]
    objects = ObjectStore(str(tmp_path / "objects"))
    announcer = CheckpointAnnouncer(db, objects, ManifestFinder(objects), producer="trainer_agent")
    agent = AgentService(
        store,
        LocalProcessRunner(),
        node,
        runs_dir=tmp_path / "runs",
        announcer=announcer,
        objects_url=objects.root_url,
    )
    try:
        command = start_job("job-ckpt", [sys.executable, "-c", JOB])
        await agent.start_job(command)
        job_id = command.job.id

        async def finished() -> bool:
            runs, _ = await agent.list_runs(job_id, 10, 0)
            return bool(runs) and runs[0].finished_at is not None

        # The job imports torch: slow on a loaded machine.
        await eventually(finished, timeout_s=120, what="the checkpointing job to finish")
    finally:
        await agent.shutdown(grace_s=0)
    [run] = (await agent.list_runs(job_id, 10, 0))[0]
    assert run.exit_code == 0, run.message
    [event] = await outbox(db)
    assert (event.job_id, event.step) == (job_id, 20)
    assert event.manifest_uri.endswith(f"checkpoints/{job_id}/step-00000020/manifest.json")
    assert event.uri == str((tmp_path / "runs" / job_id / "hf").resolve())
    assert event.metrics["val_loss"] == 1.0
    assert run.last_checkpoint_step == 20
    # Announcing again (a retried finish, an agent restart) stages nothing new.
    assert not await announcer.announce(run, tmp_path / "runs" / job_id)
    assert len(await outbox(db)) == 1
