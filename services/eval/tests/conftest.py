from __future__ import annotations

import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from forge_eval.registry import ModelRegistry
from forge_eval.runner import ExampleResult
from forge_eval.runs import RunService
from forge_eval.spec import BenchmarkCatalog, RunSpec
from forge_kit.db import Database
from forge_kit.events import OutboxEvent
from forge_kit.paths import resolve_data_path

sys.path.insert(0, str(Path(__file__).parent))

MIGRATIONS = Path(__file__).parents[1] / "src" / "forge_eval" / "migrations"
BENCHMARKS = resolve_data_path("benchmarks")


class ScriptedRunner:
    """Stands in for the model: scores per model version are given by the test (0/1 per example)."""

    def __init__(self, scores: dict[str, list[float]] | None = None) -> None:
        self.scores = scores or {}
        self.calls: list[RunSpec] = []

    def supports(self, suite: str) -> bool:
        return suite in {"gsm8k", "bbh", "mmlu"}

    def scorer_version(self, suite: str) -> str:
        return f"{suite}-scripted-1"

    async def run(self, spec: RunSpec, endpoint: str, *, token: str | None = None) -> list[ExampleResult]:
        self.calls.append(spec)
        return [
            ExampleResult(f"ex-{i}", "accuracy", score, output=str(score), target="1")
            for i, score in enumerate(self.scores.get(spec.model_version, []))
        ]


@pytest.fixture(scope="session")
def catalog() -> BenchmarkCatalog:
    return BenchmarkCatalog(BENCHMARKS)


@pytest.fixture
def db_migrations() -> Path:
    """This service's migrations, for forge_kit.testing's ``db`` fixture."""
    return MIGRATIONS


@pytest.fixture
def runner() -> ScriptedRunner:
    return ScriptedRunner()


@pytest.fixture
def registry(db: Database) -> ModelRegistry:
    return ModelRegistry(db)


@pytest.fixture
def runs(db: Database, catalog: BenchmarkCatalog, runner: ScriptedRunner) -> RunService:
    return RunService(db, catalog, runner, default_endpoint="http://127.0.0.1:9/")


@pytest.fixture
def outbox(db: Database):  # type: ignore[no-untyped-def]
    async def rows() -> list[OutboxEvent]:
        async with db.session() as session:
            return list((await session.scalars(sa.select(OutboxEvent).order_by(OutboxEvent.sequence))).all())

    return rows


@pytest.fixture
def run_model(runs: RunService, runner: ScriptedRunner):  # type: ignore[no-untyped-def]
    """Queue and execute a gsm8k run of ``name:version`` whose per-example scores are ``scores``."""

    async def run(
        version: str, scores: list[float], *, name: str = "tiny", suite: str = "gsm8k", **kwargs: object
    ) -> str:
        runner.scores[version] = scores
        queued = await runs.run_suite(
            suite, name, version, endpoint="", limit=len(scores), seed=1, options={}, **kwargs
        )  # type: ignore[arg-type]
        claimed = await runs.claim_next_run()
        assert claimed == queued.id
        await runs.execute_run(queued.id)
        return queued.id

    return run
