from __future__ import annotations

import datetime as dt
import gzip
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from forge_kit.db import Database
from forge_kit.paths import resolve_data_path
from forge_preference_feedback.registry import RewardModelRegistry
from forge_preference_feedback.service import FeedbackService
from forge_preference_feedback.transactions import AsyncTransactions, SqliteGroupCommit, Transactions

MIGRATIONS = Path(__file__).parents[1] / "src" / "forge_preference_feedback" / "migrations"
HH_RLHF = resolve_data_path("preferences/hh-rlhf")


def read_hh_line(subset: str, number: int) -> dict[str, str]:
    """Line ``number`` (0-based) of the real HH-RLHF test file of ``subset``."""
    with gzip.open(HH_RLHF / subset / "test.jsonl.gz", "rt", encoding="utf-8") as handle:
        for i, line in enumerate(handle):
            if i == number:
                return dict(json.loads(line))
    raise IndexError(number)


@pytest.fixture(scope="session")
def hh_root() -> Path:
    """The real HH-RLHF folder in the shared data."""
    return HH_RLHF


@pytest.fixture(scope="session")
def hh_line() -> Callable[[str, int], dict[str, str]]:
    """``hh_line(subset, n)``: line n of the real HH-RLHF test file of a subset."""
    return read_hh_line


class Clock:
    """A settable clock for leases."""

    def __init__(self) -> None:
        self.now = dt.datetime(2026, 1, 1, 12, 0, 0)

    def __call__(self) -> dt.datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += dt.timedelta(seconds=seconds)


@pytest.fixture(params=["async", "group-commit"])
def hot_path(request: pytest.FixtureRequest) -> str:
    """How the hot path runs its transactions: on the async engine (any database) or on SQLite's
    group-commit writer thread; a module may add ``postgres`` (the async engine on PostgreSQL)."""
    return str(request.param)


@pytest.fixture
async def db(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Database]:
    """SQLite in the test's folder; PostgreSQL when the test runs the hot path there."""
    postgres = "hot_path" in request.fixturenames and request.getfixturevalue("hot_path") == "postgres"
    url = (
        request.getfixturevalue("postgres_url")
        if postgres
        else f"sqlite+aiosqlite:///{tmp_path / 'feedback.db'}"
    )
    database = Database(url)
    await database.migrate(MIGRATIONS)
    yield database
    await database.dispose()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def transactions(hot_path: str, db: Database) -> AsyncIterator[Transactions]:
    runner: Transactions = SqliteGroupCommit(db.url) if hot_path == "group-commit" else AsyncTransactions(db)
    yield runner
    await runner.close()


@pytest.fixture
def service(db: Database, clock: Clock, transactions: Transactions) -> FeedbackService:
    return FeedbackService(db, lease=dt.timedelta(seconds=60), clock=clock, transactions=transactions)


@pytest.fixture
def registry(db: Database, clock: Clock) -> RewardModelRegistry:
    return RewardModelRegistry(db, clock=clock)
