"""Database on SQLite and PostgreSQL: unit of work, migrations with the kit tables."""

from __future__ import annotations

import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from forge_kit.db import Base, Database
from forge_kit.events import OutboxEvent  # noqa: F401 - registers the kit tables on Base

ENV_PY = """
from forge_kit.db import Base, run_alembic_env
import forge_kit.events  # noqa: F401

run_alembic_env(Base.metadata)
"""

FIRST = """
revision = "0001"
down_revision = None

import sqlalchemy as sa
from alembic import op

from forge_kit.migration_ops import create_kit_tables, drop_kit_tables


def upgrade():
    create_kit_tables()
    op.create_table("widgets", sa.Column("id", sa.Integer, primary_key=True), sa.Column("name", sa.String(50)))


def downgrade():
    op.drop_table("widgets")
    drop_kit_tables()
"""


def write_migrations(root: Path) -> Path:
    (root / "versions").mkdir(parents=True)
    (root / "env.py").write_text(textwrap.dedent(ENV_PY))
    (root / "versions" / "0001_first.py").write_text(textwrap.dedent(FIRST))
    return root


@pytest_asyncio.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.integration)])
async def db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Database]:
    if request.param == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path / 'test.db'}"
    else:
        url = request.getfixturevalue("postgres_url")
    database = Database(url)
    await database.migrate(write_migrations(tmp_path / "migrations"))
    yield database
    await database.dispose()


async def names(db: Database) -> list[str]:
    async with db.session() as session:
        return list((await session.scalars(sa.text("SELECT name FROM widgets ORDER BY id"))).all())


@pytest.mark.asyncio
async def test_session_commits_on_success(db: Database) -> None:
    async with db.session() as session:
        await session.execute(sa.text("INSERT INTO widgets (name) VALUES ('a')"))
    assert await names(db) == ["a"]


@pytest.mark.asyncio
async def test_session_rolls_back_everything_on_error(db: Database) -> None:
    with pytest.raises(RuntimeError):
        async with db.session() as session:
            await session.execute(sa.text("INSERT INTO widgets (name) VALUES ('a')"))
            await session.execute(sa.text("INSERT INTO widgets (name) VALUES ('b')"))
            raise RuntimeError("crash mid-request")
    assert await names(db) == []


@pytest.mark.asyncio
async def test_migration_matches_the_kit_models_and_is_idempotent(db: Database, tmp_path: Path) -> None:
    def diff(connection: sa.Connection) -> list[object]:
        context = MigrationContext.configure(connection)
        # Only the kit's own tables: when the whole repo's tests run in one process, every
        # service's models are registered on the same Base as well.
        kit_tables = {"forge_outbox", "forge_processed_events", "forge_dead_letters"}
        kit_metadata = sa.MetaData()
        for name in kit_tables:
            Base.metadata.tables[name].to_metadata(kit_metadata)
        return [
            d
            for d in compare_metadata(context, kit_metadata)
            if not (
                isinstance(d, tuple)
                and d[0] == "remove_table"
                and d[1].name in {"widgets", "alembic_version"}
            )
        ]

    async with db.engine.connect() as connection:
        assert await connection.run_sync(diff) == []
    await db.migrate(tmp_path / "migrations")  # already at head: a no-op, not an error
    async with db.session() as session:
        version = await session.scalar(sa.text("SELECT version_num FROM alembic_version"))
    assert version == "0001"
    assert await db.ping()


@pytest.mark.asyncio
async def test_ping_is_false_when_the_database_is_unreachable(tmp_path: Path) -> None:
    db = Database(f"sqlite+aiosqlite:///{tmp_path / 'missing-dir' / 'x.db'}")
    assert not await db.ping()
    await db.dispose()


@pytest.mark.integration
@pytest.mark.asyncio
async def test_migrate_accepts_percent_encoded_urls(postgres_url: str, tmp_path: Path) -> None:
    # "%2F" in a URL (an encoded password or socket path) must reach the driver untouched.
    url = postgres_url.replace("postgres@", "postgres:p%2Fw@")
    db = Database(url)
    await db.migrate(write_migrations(tmp_path / "migrations"))
    assert await names(db) == []
    await db.dispose()


@pytest.mark.asyncio
async def test_concurrent_read_then_write_units_of_work_all_commit(db: Database) -> None:
    """Writers that read first (check, then insert — as every submit does) interleave on
    separate connections; none may fail with "database is locked" (SQLite) or lose a row."""
    import asyncio

    async def writer(w: int) -> None:
        for n in range(10):
            async with db.session() as session:
                await session.execute(sa.text("SELECT count(*) FROM widgets"))
                await asyncio.sleep(0.005)  # another writer may commit between the read and the write
                await session.execute(sa.text("INSERT INTO widgets (name) VALUES (:n)"), {"n": f"{w}-{n}"})

    await asyncio.gather(*(writer(w) for w in range(6)))
    assert sorted(await names(db)) == sorted(f"{w}-{n}" for w in range(6) for n in range(10))
