"""A full disk is told apart from other failures (a real SQLITE_FULL from SQLite through
SQLAlchemy, ENOSPC from the OS) and answered clearly: HTTP 507 and gRPC RESOURCE_EXHAUSTED with a
message, where any other unexpected error stays a bare 500 / INTERNAL."""

from __future__ import annotations

import errno
from pathlib import Path

import grpc
import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from forge_kit import errors
from forge_kit.grpc_interceptor import _status_for
from forge_kit.http import make_app


async def sqlite_full_error(path: Path) -> BaseException:
    """What SQLAlchemy raises when SQLite's database cannot grow (max_page_count reached)."""
    engine = create_async_engine(f"sqlite+aiosqlite:///{path}")
    try:
        async with engine.begin() as conn:
            await conn.execute(sa.text("CREATE TABLE t (x TEXT)"))
        async with engine.begin() as conn:
            await conn.execute(sa.text("PRAGMA max_page_count = 3"))
            with pytest.raises(sa.exc.OperationalError) as caught:
                for _ in range(100):
                    await conn.execute(sa.text("INSERT INTO t VALUES (:x)"), {"x": "y" * 4000})
        return caught.value
    finally:
        await engine.dispose()


async def test_full_disks_are_recognised_through_wrappers(tmp_path: Path) -> None:
    full = await sqlite_full_error(tmp_path / "db.sqlite")
    assert "full" in str(full)
    assert errors.storage_full(full)
    try:
        raise RuntimeError("writing the checkpoint") from OSError(errno.ENOSPC, "No space left on device")
    except RuntimeError as wrapped:
        assert errors.storage_full(wrapped)
    assert not errors.storage_full(OSError(errno.EACCES, "denied"))
    assert not errors.storage_full(RuntimeError("database is locked"))


async def test_a_full_disk_is_507_and_resource_exhausted_elsewhere_internal(tmp_path: Path) -> None:
    full = await sqlite_full_error(tmp_path / "db.sqlite")
    app = make_app("test")

    @app.post("/write")
    async def write() -> None:
        raise full

    @app.post("/bug")
    async def bug() -> None:
        raise RuntimeError("secret detail")

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        refused = await client.post("/write")
        other = await client.post("/bug")
    assert refused.status_code == 507
    assert refused.json()["error"] == {"code": "insufficient_storage", "message": errors.STORAGE_FULL_MESSAGE}
    assert other.status_code == 500 and "secret" not in other.text
    assert _status_for(full) == (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.STORAGE_FULL_MESSAGE, ())
    assert _status_for(RuntimeError("x"))[0] is grpc.StatusCode.INTERNAL
