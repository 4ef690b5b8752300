"""Announcing checkpoints: when an attempt ends (finished or preempted) the agent looks for the
newest complete checkpoint the job published under ``checkpoints/<job id>/`` in the object store,
records it on the run, and stages ``CheckpointPublished`` in the same transaction (outbox), so the
event is never lost and never announced twice for one step.

The manifest is the proof of completeness (written last, with checksums); a job that died before
writing one announces nothing. The Hugging Face export, when the job wrote one to
``<run dir>/hf``, is the event's ``uri`` — what eval and the model servers load.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from forge.events.v1 import events_pb2

from forge_kit.db import Database
from forge_kit.events import stage_event
from forge_kit.objectstore import ObjectStore
from forge_trainer_agent.store import RunRow


@dataclass(frozen=True)
class Published:
    """The newest complete checkpoint of a job."""

    step: int
    manifest_key: str
    metrics: dict[str, float]


class CheckpointFinder(Protocol):
    """Finds a job's newest complete checkpoint. Called by :class:`CheckpointAnnouncer`."""

    def latest(self, job_id: str) -> Published | None:
        """None when the job published no complete checkpoint."""


class ManifestFinder:
    """:class:`CheckpointFinder` over the training runtime's manifests in the object store."""

    def __init__(self, store: ObjectStore) -> None:
        self._store = store

    def latest(self, job_id: str) -> Published | None:
        from forge_training.checkpoint import CheckpointManager  # torch: import late

        manifest = CheckpointManager(self._store, job_id, async_save=False).latest_manifest()
        if manifest is None:
            return None
        raw = manifest.meta.get("metrics", {})
        metrics = (
            {str(k): float(v) for k, v in raw.items() if isinstance(v, int | float)}
            if isinstance(raw, dict)
            else {}
        )
        return Published(step=manifest.step, manifest_key=manifest.key, metrics=metrics)


class CheckpointAnnouncer:
    """Records and announces a run's newest checkpoint; idempotent per (job, step)."""

    def __init__(self, db: Database, store: ObjectStore, finder: CheckpointFinder, *, producer: str) -> None:
        self._db = db
        self._store = store
        self._finder = finder
        self._producer = producer

    async def announce(self, row: RunRow, run_dir: Path) -> bool:
        """Stage ``CheckpointPublished`` for a checkpoint newer than the run's last; True if staged."""
        found = await asyncio.to_thread(self._finder.latest, row.job_id)
        if found is None or found.step <= row.last_checkpoint_step:
            return False
        export = run_dir / "hf"
        uri = str(export.resolve()) if (export / "config.json").exists() else ""
        manifest_uri = self._store.url(found.manifest_key)
        async with self._db.session() as session:
            stored = await session.get(RunRow, (row.job_id, row.attempt))
            if stored is None or found.step <= stored.last_checkpoint_step:
                return False
            stored.last_checkpoint_step = found.step
            stored.last_checkpoint_uri = manifest_uri
            event = events_pb2.CheckpointPublished(
                job_id=row.job_id,
                run_id=row.run_id,
                step=found.step,
                uri=uri,
                manifest_uri=manifest_uri,
                metrics=found.metrics,
            )
            await stage_event(session, event, producer=self._producer, key=row.job_id)
        row.last_checkpoint_step, row.last_checkpoint_uri = found.step, manifest_uri
        return True
