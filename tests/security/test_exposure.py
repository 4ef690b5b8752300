"""Issue 22, hole 8, from the attacker's side: another local user (or tenant) must not learn what
it should not from files on disk, the model list, RAG error answers, the process table or logs."""

from __future__ import annotations

import stat
from pathlib import Path

from forge_kit import audit
from forge_kit.db import Database
from forge_kit.settings import ServiceSettings


def _others_can_access(path: Path) -> bool:
    return bool(stat.S_IMODE(path.stat().st_mode) & 0o077)


async def test_databases_are_private_to_their_service(tmp_path: Path) -> None:
    settings = ServiceSettings(data_dir=str(tmp_path / "var" / "data" / "svc"), kafka_enabled=False)
    db = Database(settings.sqlite_url("svc.db"))
    try:
        async with db.engine.begin() as conn:
            await conn.exec_driver_sql("create table t (secret text)")
            await conn.exec_driver_sql("insert into t values ('x')")
        files = sorted(Path(settings.data_dir).iterdir())
        assert {f.name for f in files} >= {"svc.db", "svc.db-wal", "svc.db-shm"}
        for path in [Path(settings.data_dir), tmp_path / "var", *files]:
            assert not _others_can_access(path), f"{path} is {oct(path.stat().st_mode)}"
    finally:
        await db.dispose()


async def test_a_database_named_by_url_is_private(tmp_path: Path) -> None:
    path = tmp_path / "state" / "direct.db"
    path.parent.mkdir()
    db = Database(f"sqlite+aiosqlite:///{path}")
    try:
        async with db.engine.begin() as conn:
            await conn.exec_driver_sql("create table t (x int)")
        assert not _others_can_access(path)
    finally:
        await db.dispose()


def test_the_audit_log_is_private(tmp_path: Path) -> None:
    before = audit.path()
    folder = tmp_path / "var" / "data" / "scheduler"
    try:
        log = audit.configure(folder)
        audit.record("SetQuota", "alice", "OK", team="a")
        assert not _others_can_access(log) and not _others_can_access(folder)
        log.chmod(0o644)  # loosened by hand: the next write tightens it again
        audit.record("SetQuota", "alice", "OK", team="b")
        assert not _others_can_access(log)
    finally:
        audit._path = before


def test_the_eval_response_cache_is_private(tmp_path: Path) -> None:
    from forge_eval.backend import ResponseCache

    path = tmp_path / "var" / "cache" / "eval" / "responses.sqlite"
    ResponseCache(path)
    assert not _others_can_access(path) and not _others_can_access(path.parent)
