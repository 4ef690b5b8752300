"""FeedbackService: seeding, assignment with leases, preferences with events, reward models."""

from __future__ import annotations

from itertools import islice
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from forge.common.v1 import common_pb2
from forge.events.v1 import events_pb2

from forge_kit import errors
from forge_kit.db import Database
from forge_kit.events import OutboxEvent
from forge_preference_feedback.seeds import PreferencePair, read_hh_rlhf
from forge_preference_feedback.service import FeedbackService
from forge_preference_feedback.store import AssignmentRow, ComparisonRow, PreferenceRow

pytestmark = pytest.mark.asyncio
A, B = common_pb2.PREFERENCE_CHOICE_A, common_pb2.PREFERENCE_CHOICE_B


@pytest.fixture(params=["async", "group-commit", "postgres"])
def hot_path(request: pytest.FixtureRequest) -> str:
    """Every way the hot path runs here, PostgreSQL included (conftest's ``db`` follows it)."""
    return str(request.param)


def pairs(n: int) -> list[PreferencePair]:
    return [PreferencePair("test", f"test/k:{i}", f"prompt {i}", f"good {i}", f"bad {i}") for i in range(n)]


async def count(db: Database, table: type) -> int:
    async with db.session() as session:
        return int(await session.scalar(sa.select(sa.func.count()).select_from(table)) or 0)


async def outbox(db: Database) -> list[OutboxEvent]:
    async with db.session() as session:
        return list((await session.scalars(sa.select(OutboxEvent).order_by(OutboxEvent.sequence))).all())


async def test_seeding_real_pairs_is_idempotent(
    service: FeedbackService, db: Database, hh_root: Path
) -> None:
    first = await service.seed_comparisons(read_hh_rlhf(hh_root), limit=10, rng_seed=0)
    again = await service.seed_comparisons(read_hh_rlhf(hh_root), limit=12, rng_seed=0)
    assert (first.added, first.already_present, again.added, again.already_present) == (10, 0, 2, 10)
    async with db.session() as session:
        rows = (await session.scalars(sa.select(ComparisonRow).order_by(ComparisonRow.seq))).all()
    assert len(rows) == 12 and [r.seq for r in rows] == list(range(1, 13))
    assert {r.source for r in rows} == {"hh-rlhf/helpful-base", "hh-rlhf/harmless-base"}
    assert {r.gold_choice for r in rows} == {"A", "B"}
    for row, pair in zip(rows, islice(read_hh_rlhf(hh_root), 12), strict=True):
        gold = row.response_a_text if row.gold_choice == "A" else row.response_b_text
        assert (row.prompt, gold) == (pair.prompt, pair.chosen)


async def test_seed_limit_must_be_positive(service: FeedbackService) -> None:
    with pytest.raises(errors.ValidationError) as caught:
        await service.seed_comparisons(pairs(1), limit=0, rng_seed=0)
    assert caught.value.field == "limit"


async def test_next_comparison_leases_and_avoids_collisions(service: FeedbackService, clock: Any) -> None:
    await service.seed_comparisons(pairs(3), limit=3, rng_seed=0)
    alice = await service.next_comparison("alice")
    assert alice is not None
    assert (await service.next_comparison("alice")).id == alice.id  # type: ignore[union-attr]  # same item on reload
    bob = await service.next_comparison("bob")
    carol = await service.next_comparison("carol")
    assert len({alice.id, bob.id, carol.id}) == 3  # type: ignore[union-attr]
    dave = await service.next_comparison("dave")  # everything is leased: overlap rather than no work
    assert dave is not None
    clock.advance(61)  # alice's lease lapsed and she never answered: she is offered work again
    assert await service.next_comparison("alice") is not None


async def test_answered_comparisons_are_not_offered_again(service: FeedbackService) -> None:
    await service.seed_comparisons(pairs(2), limit=2, rng_seed=0)
    for _ in range(2):
        item = await service.next_comparison("alice")
        assert item is not None
        await service.submit_preference(item.id, "alice", A, 0.9, "")
    assert await service.next_comparison("alice") is None
    assert await service.next_comparison("bob") is not None


async def test_submit_records_preference_and_stages_event_with_texts(
    service: FeedbackService, db: Database
) -> None:
    await service.seed_comparisons(pairs(1), limit=1, rng_seed=0)
    item = await service.next_comparison("alice")
    assert item is not None
    pref = await service.submit_preference(item.id, "alice", B, 0.75, "more helpful")
    (row,) = await outbox(db)
    event = events_pb2.PreferenceRecorded.FromString(row.payload)
    assert row.key == item.id.encode() and event.meta.producer == "preference_feedback"
    assert (event.preference_id, event.comparison_id, event.rater_id, event.prompt) == (
        pref.id,
        item.id,
        "alice",
        "prompt 0",
    )
    assert (event.chosen_response_id, event.chosen_text) == (item.response_b_id, item.response_b_text)
    assert (event.rejected_response_id, event.rejected_text) == (item.response_a_id, item.response_a_text)
    assert event.choice == B and event.confidence == pytest.approx(0.75)


async def test_tie_keeps_a_as_chosen(service: FeedbackService, db: Database) -> None:
    await service.seed_comparisons(pairs(1), limit=1, rng_seed=0)
    item = await service.next_comparison("alice")
    assert item is not None
    await service.submit_preference(item.id, "alice", common_pb2.PREFERENCE_CHOICE_TIE, 0.5, "")
    event = events_pb2.PreferenceRecorded.FromString((await outbox(db))[0].payload)
    assert (event.chosen_response_id, event.rejected_response_id) == (item.response_a_id, item.response_b_id)


async def test_retry_records_once_and_a_changed_answer_is_refused(
    service: FeedbackService, db: Database
) -> None:
    await service.seed_comparisons(pairs(1), limit=1, rng_seed=0)
    item = await service.next_comparison("alice")
    assert item is not None
    first = await service.submit_preference(item.id, "alice", A, 0.8, "clear")
    retry = await service.submit_preference(item.id, "alice", A, 0.8, "clear")
    assert retry.id == first.id
    with pytest.raises(errors.AlreadyExistsError, match=first.id):
        await service.submit_preference(item.id, "alice", B, 0.8, "clear")
    assert await count(db, PreferenceRow) == 1 and len(await outbox(db)) == 1


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"comparison_id": ""}, "comparison_id"),
        ({"comparison_id": "cmp-missing"}, "comparison_id"),
        ({"rater_id": ""}, "rater_id"),
        ({"rater_id": "bad rater"}, "rater_id"),
        ({"choice": common_pb2.PREFERENCE_CHOICE_UNSPECIFIED}, "choice"),
        ({"choice": 99}, "choice"),
        ({"confidence": 1.5}, "confidence"),
        ({"confidence": -0.1}, "confidence"),
        ({"confidence": float("nan")}, "confidence"),
        ({"rationale": "x" * 4001}, "rationale"),
        ({"rater_id": "bob"}, "comparison_id"),  # not assigned to bob
    ],
)
async def test_bad_submissions_name_the_field_and_write_nothing(
    service: FeedbackService, db: Database, change: dict[str, Any], field: str
) -> None:
    await service.seed_comparisons(pairs(1), limit=1, rng_seed=0)
    item = await service.next_comparison("alice")
    assert item is not None
    args: dict[str, Any] = {
        "comparison_id": item.id,
        "rater_id": "alice",
        "choice": A,
        "confidence": 0.5,
        "rationale": "",
    }
    args.update(change)
    with pytest.raises(errors.ValidationError) as caught:
        await service.submit_preference(**args)
    assert caught.value.field == field
    assert await count(db, PreferenceRow) == 0 and await outbox(db) == []


async def test_next_comparison_needs_a_rater(service: FeedbackService, db: Database) -> None:
    await service.seed_comparisons(pairs(1), limit=1, rng_seed=0)
    with pytest.raises(errors.ValidationError) as caught:
        await service.next_comparison("")
    assert caught.value.field == "rater_id" and await count(db, AssignmentRow) == 0


async def test_empty_queue_gives_nothing(service: FeedbackService) -> None:
    assert await service.next_comparison("alice") is None
