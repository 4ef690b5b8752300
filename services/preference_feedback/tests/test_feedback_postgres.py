"""The feedback schema, assignment query and preferences work on PostgreSQL as on SQLite."""

from __future__ import annotations

from pathlib import Path

import pytest
from forge.common.v1 import common_pb2

from forge_kit.db import Database
from forge_preference_feedback.registry import HeldoutAccuracy, RewardModelRegistry
from forge_preference_feedback.seeds import read_hh_rlhf
from forge_preference_feedback.service import FeedbackService

pytestmark = [pytest.mark.asyncio, pytest.mark.integration]
MIGRATIONS = Path(__file__).parents[1] / "src" / "forge_preference_feedback" / "migrations"


async def test_seed_assign_submit_on_postgres(postgres_url: str, hh_root: Path) -> None:
    db = Database(postgres_url)
    try:
        await db.migrate(MIGRATIONS)
        service = FeedbackService(db)
        assert (await service.seed_comparisons(read_hh_rlhf(hh_root), limit=3, rng_seed=0)).added == 3
        first = await service.next_comparison("alice")
        other = await service.next_comparison("bob")
        assert first is not None and other is not None and first.id != other.id
        pref = await service.submit_preference(first.id, "alice", common_pb2.PREFERENCE_CHOICE_A, 1.0, "")
        again = await service.submit_preference(first.id, "alice", common_pb2.PREFERENCE_CHOICE_A, 1.0, "")
        assert pref.id == again.id
        registry = RewardModelRegistry(db)
        heldout = HeldoutAccuracy(0.55, 0.51, 0.59, 600, "wilson")
        await registry.register(
            "rm", "", uri="file:///rm", snapshot_id="s1", backbone="b", heldout=heldout, registered_by="t"
        )
        await registry.set_status("rm", "1", "active", changed_by="t")
        assert (await registry.get("rm", "active")).heldout_n == 600
    finally:
        await db.dispose()
