from __future__ import annotations

import sys
from pathlib import Path

import pytest

from forge_kit.db import Database
from forge_scheduler.service import SchedulerService

sys.path.insert(0, str(Path(__file__).parent))

MIGRATIONS = Path(__file__).parents[1] / "src" / "forge_scheduler" / "migrations"


@pytest.fixture
def db_migrations() -> Path:
    """This service's migrations, for forge_kit.testing's ``db`` fixture."""
    return MIGRATIONS


@pytest.fixture
async def service(db: Database) -> SchedulerService:
    return SchedulerService(db)
