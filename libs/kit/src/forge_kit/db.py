"""Database access: SQLAlchemy 2 async, one database per service, Alembic migrations.

SQLite (``sqlite+aiosqlite:///var/data/x.db``) is the embedded default; PostgreSQL
(``postgresql+asyncpg://…``) is chosen by URL alone. Each service keeps its migrations in
``forge_<service>/migrations`` and calls :meth:`Database.migrate` at start-up. A SQLite file is
created 0600 in a 0700 folder (its WAL and shared-memory files follow its mode).
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from sqlalchemy import event
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase

from forge_kit.paths import private_file


def utcnow() -> dt.datetime:
    """Now in UTC, naive: what every service's ``DateTime`` columns hold (SQLite keeps no zone)."""
    return dt.datetime.now(dt.UTC).replace(tzinfo=None)


class Base(DeclarativeBase):
    """Declarative base for tables shared by every service (outbox, processed events)."""


def _sqlite_pragmas(dbapi_connection: object, _record: object) -> None:
    cursor = dbapi_connection.cursor()  # type: ignore[attr-defined]
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")  # as the driver's timeout: a writer queues, it does not fail
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


class Database:
    """An async engine plus a session factory; ``session()`` commits on success, rolls back on error."""

    def __init__(self, url: str, *, echo: bool = False) -> None:
        self.url = url
        kwargs: dict[str, object] = {"echo": echo}
        if url.startswith("sqlite"):
            kwargs["connect_args"] = {"timeout": 30}
        else:
            kwargs.update(pool_size=5, max_overflow=10, pool_pre_ping=True)
        if url.startswith("sqlite"):
            database = sa.make_url(url).database
            if database and database != ":memory:" and Path(database).parent.is_dir():
                private_file(database)  # before SQLite creates it with the umask's mode
        self.engine: AsyncEngine = create_async_engine(url, **kwargs)
        if url.startswith("sqlite"):
            event.listen(self.engine.sync_engine, "connect", _sqlite_pragmas)
        self._sessions = async_sessionmaker(self.engine, expire_on_commit=False)

    @asynccontextmanager
    async def session(self) -> AsyncIterator[AsyncSession]:
        """One unit of work: everything inside commits together or not at all."""
        async with self._sessions() as session:
            try:
                yield session
                await session.commit()
            except BaseException:
                await session.rollback()
                raise

    async def migrate(self, migrations_dir: str | Path) -> None:
        """Upgrade this database to the newest revision in ``migrations_dir``."""
        config = Config()
        config.set_main_option("script_location", str(migrations_dir))
        # Alembic's config is a ConfigParser: a literal "%" (URL-encoded passwords) must be doubled.
        config.set_main_option("sqlalchemy.url", self.url.replace("%", "%%"))

        def upgrade(connection: Connection) -> None:
            config.attributes["connection"] = connection
            command.upgrade(config, "head")

        async with self.engine.begin() as connection:
            await connection.run_sync(upgrade)

    async def ping(self) -> bool:
        """True when a trivial query succeeds (readiness)."""
        try:
            async with self.engine.connect() as connection:
                await connection.execute(sa.text("SELECT 1"))
        except Exception:  # noqa: BLE001 - readiness reports, never raises
            return False
        return True

    async def dispose(self) -> None:
        """Close every pooled connection."""
        await self.engine.dispose()


def run_alembic_env(target_metadata: sa.MetaData) -> None:
    """Body of a service's ``migrations/env.py``: migrate on the connection handed over by
    :meth:`Database.migrate`, or on a fresh sync engine when run from the ``alembic`` CLI."""
    from alembic import context

    connection = context.config.attributes.get("connection")
    if connection is not None:
        context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
        return
    url = context.config.get_main_option("sqlalchemy.url") or ""
    engine = create_async_engine(url)

    def run(sync_connection: Connection) -> None:
        context.configure(connection=sync_connection, target_metadata=target_metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()

    async def main() -> None:
        async with engine.begin() as conn:
            await conn.run_sync(run)
        await engine.dispose()

    asyncio.run(main())
