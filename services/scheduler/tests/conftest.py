from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from forge_kit.db import Database
from forge_scheduler.service import SchedulerService

sys.path.insert(0, str(Path(__file__).parent))

MIGRATIONS = Path(__file__).parents[1] / "src" / "forge_scheduler" / "migrations"


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[Database]:
    database = Database(f"sqlite+aiosqlite:///{tmp_path / 'scheduler.db'}")
    await database.migrate(MIGRATIONS)
    yield database
    await database.dispose()


@pytest.fixture
async def service(db: Database) -> SchedulerService:
    return SchedulerService(db)
