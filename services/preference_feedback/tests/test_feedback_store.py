"""The hot path's transactions: SQLite group commit (savepoint per unit, durable before the
answer) and the session check's in-process memory."""

from __future__ import annotations

import asyncio
import datetime as dt
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import sqlalchemy as sa
from argon2 import PasswordHasher
from prometheus_client import REGISTRY

from forge_kit.db import Database
from forge_preference_feedback.seeds import read_hh_rlhf
from forge_preference_feedback.service import FeedbackService
from forge_preference_feedback.store import HotPath, SessionRow, utcnow
from forge_preference_feedback.transactions import PrecompiledConnection, SqliteGroupCommit, UnitConnection

if TYPE_CHECKING:
    from conftest import Clock

pytestmark = pytest.mark.asyncio
NOTES = sa.table("notes", sa.column("id", sa.Integer), sa.column("text", sa.String))


def committed_units() -> float:
    """Units the group-commit writers have run, from their Prometheus histogram."""
    return REGISTRY.get_sample_value("forge_feedback_group_commit_units_sum") or 0.0


async def test_group_commit_undoes_only_the_failing_unit_and_answers_after_commit(db: Database) -> None:
    path = db.engine.url.database
    assert path
    with sqlite3.connect(path) as setup:
        setup.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT NOT NULL)")
    writer = SqliteGroupCommit(db.url)
    units_before = committed_units()

    def write(i: int) -> Callable[[UnitConnection], int]:
        def unit(conn: UnitConnection) -> int:
            conn.execute(sa.insert(NOTES).values(id=i, text=f"note {i}"))
            if i % 3 == 0:
                raise ValueError(f"unit {i} fails after writing")
            return i

        return unit

    try:
        results = await asyncio.gather(*(writer.run(write(i)) for i in range(1, 31)), return_exceptions=True)
        # Each answer came after its commit: another connection sees exactly the surviving rows.
        with sqlite3.connect(path) as reader:
            stored = [row[0] for row in reader.execute("SELECT id FROM notes ORDER BY id")]
    finally:
        await writer.close()
    assert [r for r in results if isinstance(r, ValueError)] and len(results) == 30
    assert stored == [i for i in range(1, 31) if i % 3] == [r for r in results if isinstance(r, int)]
    assert committed_units() - units_before == 30


async def test_a_failed_commit_fails_every_unit_of_the_batch(db: Database) -> None:
    writer = SqliteGroupCommit(db.url)
    try:
        with pytest.raises(sa.exc.OperationalError, match="no such table"):
            await writer.run(lambda conn: conn.execute(sa.text("INSERT INTO missing VALUES (1)")))
        assert await writer.run(lambda conn: conn.execute(sa.text("SELECT 41 + 1")).scalar_one()) == 42
    finally:
        await writer.close()


async def test_sessions_are_remembered_briefly_and_logout_ends_them_at_once(
    db: Database, clock: Clock
) -> None:
    fast = PasswordHasher(time_cost=1, memory_cost=8, parallelism=1)
    service = FeedbackService(
        db, clock=clock, hasher=fast, session_ttl=dt.timedelta(hours=1), session_cache=dt.timedelta(seconds=5)
    )
    await service.create_rater("alice", "correct horse battery")
    token, _ = await service.login("alice", "correct horse battery")
    assert (await service.session_for(token)) is not None
    # Another replica logs the session out (the row goes): this process notices within 5 s.
    async with db.session() as session:
        await session.execute(sa.delete(SessionRow))
    assert (await service.session_for(token)) is not None
    clock.advance(6)
    assert (await service.session_for(token)) is None
    # A logout here takes effect at once; an expired session is never served from memory.
    token, _ = await service.login("alice", "correct horse battery")
    assert (await service.session_for(token)) is not None
    await service.logout(token)
    assert (await service.session_for(token)) is None
    token, _ = await service.login("alice", "correct horse battery")
    assert (await service.session_for(token)) is not None
    clock.advance(3600)
    assert (await service.session_for(token)) is None


async def test_concurrent_raters_are_handed_different_items(service: FeedbackService, hh_root: Path) -> None:
    """Assignment reads the leases it then extends, so it runs serially (``serial=True``) in both
    transaction modes: raters asking at the same moment each get an item of their own, and no item
    ends up with more holders than the overlap allows."""
    await service.seed_comparisons(read_hh_rlhf(hh_root), limit=12, rng_seed=0)
    raters = [f"rater-{n}" for n in range(12)]
    items = await asyncio.gather(*(service.next_comparison(r) for r in raters))
    assert len({item.id for item in items if item}) == len(raters)


async def test_precompiled_hot_path_reads_and_fails_as_sqlalchemy_does(db: Database, hh_root: Path) -> None:
    """On the writer thread the hot path's statements run on ``sqlite3`` directly: every select
    returns the rows SQLAlchemy returns for it (types processed: datetimes come back as
    datetimes), a constraint violation is SQLAlchemy's ``IntegrityError`` (what a concurrent
    identical answer relies on) and undoes only its own unit."""
    service = FeedbackService(db, lease=dt.timedelta(seconds=60))
    await service.seed_comparisons(read_hh_rlhf(hh_root), limit=4, rng_seed=0)
    item = await service.next_comparison("alice")
    assert item is not None
    answered = await service.submit_preference(item.id, "alice", 1, 0.8, "clearer")
    await service.next_comparison("bob")
    writer = SqliteGroupCommit(db.url)
    now = utcnow()
    params = {"rid": "alice", "cid": item.id, "now": now, "k": 3}
    selects = [
        HotPath.held,
        HotPath.free,
        HotPath.held_by_others,
        HotPath.comparison,
        HotPath.answer,
        HotPath.lease,
    ]

    def both(conn: UnitConnection) -> list[tuple[object, object]]:
        assert isinstance(conn, PrecompiledConnection)
        pairs = []
        for statement in selects:
            fast, slow = (
                conn.execute(statement, params).first(),
                conn.connection.execute(statement, params).first(),
            )
            pairs.append((fast and fast._mapping, slow and dict(slow._mapping)))
        return pairs

    def lease_again(conn: UnitConnection) -> None:
        lease = {"comparison_id": item.id, "rater_id": "alice", "assigned_at": now, "expires_at": now}
        conn.execute(HotPath.insert_lease, lease)

    def count(conn: UnitConnection) -> int:
        return int(conn.execute(HotPath.count_answer, {"cid": item.id}).rowcount)

    try:
        pairs = await writer.run(both)
        outcomes = await asyncio.gather(writer.run(lease_again), writer.run(count), return_exceptions=True)
        after = await service.get_comparison(item.id)
    finally:
        await writer.close()
    for fast, slow in pairs:
        assert fast == slow
    assert any(fast for fast, _ in pairs) and pairs[4][0]["id"] == answered.id
    assert isinstance(pairs[5][0]["assigned_at"], dt.datetime)
    assert isinstance(outcomes[0], sa.exc.IntegrityError) and outcomes[1] == 1
    assert after.answer_count == 2  # the failed unit took nothing with it
