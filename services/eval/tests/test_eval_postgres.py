"""The eval schema and registry work on PostgreSQL as they do on SQLite."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from forge_eval.registry import ModelRegistry
from forge_eval.runs import RunService
from forge_eval.spec import BenchmarkCatalog
from forge_eval.store.runs import RunStatus
from forge_kit.db import Database

pytestmark = [pytest.mark.asyncio, pytest.mark.integration]
MIGRATIONS = Path(__file__).parents[1] / "src" / "forge_eval" / "migrations"


async def test_registry_and_runs_on_postgres(
    postgres_url: str, catalog: BenchmarkCatalog, runner: Any
) -> None:
    runner.scores["1"] = [1.0, 0.0, 1.0]
    db = Database(postgres_url)
    try:
        await db.migrate(MIGRATIONS)
        registry = ModelRegistry(db)
        runs = RunService(db, catalog, runner, default_endpoint="http://127.0.0.1:9")
        await registry.register_model("tiny", "", "file:///1", {"job": "j"})
        await registry.register_model("tiny", "", "file:///2", {})
        run = await runs.run_suite("gsm8k", "tiny", "1", endpoint="", limit=3, seed=2**63 - 1, options={})
        assert await runs.claim_next_run() == run.id
        await runs.execute_run(run.id)
        got, metrics = await runs.get_run(run.id)
        assert got.status == RunStatus.SUCCEEDED and metrics[0].value == pytest.approx(2 / 3)
        await registry.promote_model("tiny", "1", "production", traffic_percent=0, reason="")
        await registry.promote_model(
            "tiny", "2", "production", traffic_percent=0, reason="no runs yet", force=True, actor="alice"
        )
        back = await registry.rollback_model("production", "")
        assert back.model.row.version == "1" and back.previous is not None and back.previous.version == "2"
        forced, _ = await registry.list_stage_events("tiny", "2", "", forced_only=True, page_size=5, offset=0)
        assert [(e.row.actor, e.row.stage) for e in forced] == [("alice", "production")]
    finally:
        await db.dispose()
