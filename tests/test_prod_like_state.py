"""``forge up --profile prod-like`` pairs its PostgreSQL databases with its state folder: a database
left by a removed folder (a fresh clone on a machine whose PostgreSQL kept an earlier run's
databases) or by another checkout whose platform is stopped is reset, one another platform is
connected to is refused, a paired one is kept."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import asyncpg
import pytest
import redis

from forge_cli import profiles

ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"


@pytest.fixture
def names():
    prefix = f"forgetest_state_{uuid.uuid4().hex[:8]}_"
    made = [prefix + "a", prefix + "b"]
    yield made

    async def drop() -> None:
        conn = await asyncpg.connect(ADMIN)
        try:
            for name in made:
                await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()

    asyncio.run(drop())


def _pair(names: list[str], root: Path) -> profiles.Databases:
    return asyncio.run(profiles.pair_databases(ADMIN, names, root))


def _write_row(name: str, value: str) -> None:
    async def write() -> None:
        conn = await asyncpg.connect(f"postgresql://postgres@127.0.0.1:5432/{name}")
        try:
            await conn.execute("CREATE TABLE IF NOT EXISTS kept (v text)")
            await conn.execute("INSERT INTO kept VALUES ($1)", value)
        finally:
            await conn.close()

    asyncio.run(write())


def _rows(name: str) -> list[str]:
    async def read() -> list[str]:
        conn = await asyncpg.connect(f"postgresql://postgres@127.0.0.1:5432/{name}")
        try:
            if not await conn.fetchval("SELECT to_regclass('kept') IS NOT NULL"):
                return []
            return [r["v"] for r in await conn.fetch("SELECT v FROM kept")]
        finally:
            await conn.close()

    return asyncio.run(read())


def test_paired_databases_are_kept_and_a_removed_folders_are_reset(names, tmp_path: Path) -> None:
    root = tmp_path / "state"
    first = _pair(names, root)
    assert first == profiles.Databases(created=names, reset=[])
    assert (root / profiles.STATE_ID_FILE).is_file()
    _write_row(names[0], "model run-1 at /gone/hf")

    again = _pair(names, root)
    assert again == profiles.Databases(created=[], reset=[])
    assert _rows(names[0]) == ["model run-1 at /gone/hf"]

    # The state folder is removed (a fresh clone): its databases name files that no longer exist.
    (root / profiles.STATE_ID_FILE).unlink()
    reset = _pair(names, root)
    assert reset == profiles.Databases(created=[], reset=names)
    assert _rows(names[0]) == []
    # Paired with the new folder from now on.
    assert _pair(names, root) == profiles.Databases(created=[], reset=[])


def test_a_moved_folder_keeps_its_databases(names, tmp_path: Path) -> None:
    _pair(names, tmp_path / "here")
    _write_row(names[1], "kept")
    (tmp_path / "here").rename(tmp_path / "there")
    assert _pair(names, tmp_path / "there") == profiles.Databases(created=[], reset=[])
    assert _rows(names[1]) == ["kept"]


def test_databases_made_before_pairing_are_reset(names, tmp_path: Path) -> None:
    async def create() -> None:
        conn = await asyncpg.connect(ADMIN)
        try:
            await conn.execute(f'CREATE DATABASE "{names[0]}"')
        finally:
            await conn.close()

    asyncio.run(create())
    _write_row(names[0], "old")
    done = _pair(names, tmp_path / "state")
    assert done == profiles.Databases(created=[names[1]], reset=[names[0]])
    assert _rows(names[0]) == []


def test_databases_of_another_stopped_checkout_are_taken_over(names, tmp_path: Path) -> None:
    other = tmp_path / "other checkout's"  # a quote in the path reaches the comment safely
    _pair(names, other)
    _write_row(names[0], "theirs")
    done = _pair(names, tmp_path / "mine")
    assert done == profiles.Databases(created=[], reset=names)
    assert _rows(names[0]) == []
    assert (tmp_path / "mine" / profiles.STATE_ID_FILE).exists()


def test_databases_another_platform_is_connected_to_are_refused_and_kept(names, tmp_path: Path) -> None:
    other = tmp_path / "other checkout's"
    _pair(names, other)
    _write_row(names[0], "theirs")

    async def pair_while_connected() -> None:
        held = await asyncpg.connect(f"postgresql://postgres@127.0.0.1:5432/{names[0]}")
        try:
            await profiles.pair_databases(ADMIN, names, tmp_path / "mine")
        finally:
            await held.close()

    with pytest.raises(profiles.BackingUnavailable, match="is in use by the platform at"):
        asyncio.run(pair_while_connected())
    assert _rows(names[0]) == ["theirs"]
    assert not (tmp_path / "mine" / profiles.STATE_ID_FILE).exists()


def test_clear_redis_deletes_only_the_prefix(redis_url: str) -> None:
    prefix = f"forgetest-{uuid.uuid4().hex[:8]}:"
    client = redis.Redis.from_url(redis_url)
    try:
        for i in range(1200):
            client.set(f"{prefix}k{i}", "v")
        client.set(f"other-{prefix}", "v")
        assert asyncio.run(profiles.clear_redis(redis_url, prefix)) == 1200
        assert client.get(f"other-{prefix}") == b"v"
        assert list(client.scan_iter(match=f"{prefix}*")) == []
    finally:
        client.delete(f"other-{prefix}")
        client.close()


def test_only_the_services_forge_up_starts_get_a_database(tmp_path: Path) -> None:
    """The model server row is kept for Compose and Kubernetes but ``forge up`` runs none
    (``instances=0``): prod-like makes no database for it."""
    from forge_cli import platform

    names = profiles.resolve("prod-like", tmp_path).databases(platform.SERVICES)
    assert names and not any(n.endswith("model_server") for n in names)
    started = {s.name for s in platform.started(platform.SERVICES)}
    assert len(names) == len([s for s in platform.SERVICES if s.name in started]) + 1  # + MLflow's
    assert any(n.endswith("inference_gateway") for n in names)
