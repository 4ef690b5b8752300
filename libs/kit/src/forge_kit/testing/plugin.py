"""pytest fixtures for Forge tests (registered through the ``pytest11`` entry point).

Integration fixtures start real servers once per session: ``kafka_broker`` (Tansu),
``temporal_server`` (Temporal dev server), ``mlflow_server`` (an MLflow tracking server);
``postgres_url`` makes a fresh database on the PostgreSQL at ``FORGE_TEST_POSTGRES`` (default 127.0.0.1:5432) and drops it afterwards;
``redis_url`` points at the Redis at ``FORGE_TEST_REDIS_URL`` (default redis://127.0.0.1:6379/0).
``db`` is a SQLite database in the test's folder, migrated with the folder a package's conftest
names in ``db_migrations`` (every service's tests share this one fixture).
It also registers the ``integration`` marker (tests that start real servers).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import uuid
from collections.abc import AsyncIterator, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from forge_kit.db import Base, Database
from forge_kit.testing.processes import MlflowServer, TansuBroker, TemporalDevServer, free_port


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "integration: starts real servers (broker, databases, gRPC)")


def _run_sync(coro: Coroutine[Any, Any, None]) -> None:
    """Run ``coro`` to completion, also when called from inside a running event loop
    (an async fixture asking for a sync one through ``request.getfixturevalue``)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(coro)
        return
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(asyncio.run, coro).result()


@pytest.fixture
def unused_port() -> int:
    """A free TCP port."""
    return free_port()


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[TansuBroker]:
    """A real Tansu broker for the whole session (tests may stop and restart it in place)."""
    broker = TansuBroker().start()
    yield broker
    broker.stop()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """A real MLflow tracking server (SQLite backend, artifacts in a temporary folder) for the session."""
    root = tmp_path_factory.mktemp("mlflow")
    server = MlflowServer(root, log_path=str(root / "mlflow.log")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def temporal_server() -> Iterator[TemporalDevServer]:
    """A real Temporal dev server (in-memory) for the whole session."""
    server = TemporalDevServer().start()
    yield server
    server.stop()


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """An asyncpg URL of a fresh, empty PostgreSQL database, dropped after the test."""
    import asyncpg

    server = os.environ.get("FORGE_TEST_POSTGRES", "postgres@127.0.0.1:5432")
    name = f"forge_test_{uuid.uuid4().hex[:12]}"

    async def admin(sql: str) -> None:
        conn = await asyncpg.connect(f"postgresql://{server}/postgres")
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    try:
        _run_sync(admin(f'CREATE DATABASE "{name}"'))
    except (OSError, asyncpg.PostgresError) as exc:
        pytest.fail(f"PostgreSQL at {server} is required for this test: {exc}")
    yield f"postgresql+asyncpg://{server}/{name}"
    _run_sync(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def redis_url() -> str:
    """URL of the Redis server tests share; callers namespace their keys."""
    return os.environ.get("FORGE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture
def db_migrations() -> Path | None:
    """The Alembic folder the ``db`` fixture migrates to head: a package's conftest overrides this
    with its own ``migrations/``. None (the default): ``db`` creates the tables declared on
    :class:`forge_kit.db.Base` (the kit's own outbox and processed-event tables)."""
    return None


@pytest_asyncio.fixture
async def db(tmp_path: Path, db_migrations: Path | None) -> AsyncIterator[Database]:
    """A SQLite database in the test's folder, migrated (or created) from ``db_migrations``,
    disposed after the test."""
    database = Database(f"sqlite+aiosqlite:///{tmp_path / 'test.db'}")
    if db_migrations is None:
        async with database.engine.begin() as connection:
            await connection.run_sync(Base.metadata.create_all)
    else:
        await database.migrate(db_migrations)
    yield database
    await database.dispose()
