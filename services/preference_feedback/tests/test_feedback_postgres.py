"""The feedback schema, assignment query and preferences work on PostgreSQL as on SQLite."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import sqlalchemy as sa
from forge.common.v1 import common_pb2
from forge.events.v1 import events_pb2

from forge_kit.db import Database
from forge_kit.events import topic_for
from forge_preference_feedback.registry import HeldoutAccuracy, RewardModelRegistry
from forge_preference_feedback.seeds import read_hh_rlhf
from forge_preference_feedback.service import FeedbackService
from forge_preference_feedback.transactions import AsyncTransactions, UnitConnection, open_transactions

pytestmark = [pytest.mark.asyncio, pytest.mark.integration]
MIGRATIONS = Path(__file__).parents[1] / "src" / "forge_preference_feedback" / "migrations"


async def test_seed_assign_submit_on_postgres(postgres_url: str, hh_root: Path) -> None:
    db = Database(postgres_url)
    try:
        await db.migrate(MIGRATIONS)
        service = FeedbackService(db)
        assert (await service.seed_comparisons(read_hh_rlhf(hh_root), limit=3, rng_seed=0)).added == 3
        first = await service.next_comparison("alice")
        other = await service.next_comparison("bob")
        assert first is not None and other is not None and first.id != other.id
        pref = await service.submit_preference(first.id, "alice", common_pb2.PREFERENCE_CHOICE_A, 1.0, "")
        again = await service.submit_preference(first.id, "alice", common_pb2.PREFERENCE_CHOICE_A, 1.0, "")
        assert pref.id == again.id
        registry = RewardModelRegistry(db)
        heldout = HeldoutAccuracy(0.55, 0.51, 0.59, 600, "wilson")
        await registry.register(
            "rm", "", uri="file:///rm", snapshot_id="s1", backbone="b", heldout=heldout, registered_by="t"
        )
        await registry.set_status("rm", "1", "active", changed_by="t")
        assert (await registry.get("rm", "active")).heldout_n == 600
    finally:
        await db.dispose()


async def test_concurrent_raters_on_postgres_answer_each_unit_once(postgres_url: str, hh_root: Path) -> None:
    """Concurrent raters through the PostgreSQL transactions (:func:`open_transactions`): every
    answer is recorded once with one outbox event, double posts included, and a failing unit
    fails alone."""
    db = Database(postgres_url)
    tx = open_transactions(db)
    assert isinstance(tx, AsyncTransactions)
    try:
        await db.migrate(MIGRATIONS)
        service = FeedbackService(db, transactions=tx)
        await service.seed_comparisons(read_hh_rlhf(hh_root), limit=24, rng_seed=0)
        raters = [f"rater-{n}" for n in range(12)]
        items = await asyncio.gather(*(service.next_comparison(r) for r in raters))
        assert all(items) and len({i.id for i in items if i}) == len(raters)

        def boom(_: UnitConnection) -> None:
            raise ValueError("this unit fails")

        def one(connection: UnitConnection) -> int:
            return int(connection.execute(sa.text("SELECT 1")).scalar_one())

        choice = common_pb2.PREFERENCE_CHOICE_A
        posts = [
            service.submit_preference(i.id, r, choice, 1.0, "")
            for _ in range(2)
            for i, r in zip(items, raters, strict=True)
            if i
        ]
        results = await asyncio.gather(*posts, tx.run(boom), tx.run(one), return_exceptions=True)
        *answers, failed, ok = results
        assert isinstance(failed, ValueError) and ok == 1
        assert not [a for a in answers if isinstance(a, BaseException)], answers
        # Each rater's double post is the same record.
        assert len({a.id for a in answers}) == len(raters)  # type: ignore[union-attr]
        async with db.engine.connect() as connection:
            records = await connection.scalar(sa.text("SELECT count(*) FROM feedback_preferences"))
            events = await connection.scalar(
                sa.text("SELECT count(*) FROM forge_outbox WHERE topic = :topic"),
                {"topic": topic_for(events_pb2.PreferenceRecorded())},
            )
            answered = await connection.scalar(sa.text("SELECT sum(answer_count) FROM feedback_comparisons"))
        assert records == events == answered == len(raters)
    finally:
        await tx.close()
        await db.dispose()


class _Deadlock(Exception):
    sqlstate = "40P01"


async def test_a_deadlocked_unit_runs_again(postgres_url: str) -> None:
    """A unit the database aborts as a deadlock wrote nothing, so it runs again; a unit's other
    database errors go to its caller at once."""
    db = Database(postgres_url)
    tx = AsyncTransactions(db)
    calls = {"flaky": 0, "bad": 0}

    def flaky(connection: UnitConnection) -> int:
        calls["flaky"] += 1
        if calls["flaky"] == 1:
            raise sa.exc.DBAPIError("SELECT 1", None, _Deadlock("deadlock detected"))
        return int(connection.execute(sa.text("SELECT 2")).scalar_one())

    def bad_sql(connection: UnitConnection) -> None:
        calls["bad"] += 1
        connection.execute(sa.text("SELECT * FROM no_such_table"))

    try:
        flaky_result, bad = await asyncio.gather(tx.run(flaky), tx.run(bad_sql), return_exceptions=True)
        assert flaky_result == 2 and calls["flaky"] == 2
        assert isinstance(bad, sa.exc.ProgrammingError) and calls["bad"] == 1
    finally:
        await tx.close()
        await db.dispose()
