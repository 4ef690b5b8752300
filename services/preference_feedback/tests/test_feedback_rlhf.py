"""What the RLHF workflow reads and writes here: accepted-pair counts since a watermark,
content-addressed snapshots in the snapshot folder, and the rounds' records."""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
import sqlalchemy as sa
from forge.common.v1 import common_pb2
from forge.events.v1 import events_pb2

from forge_kit import errors
from forge_kit.db import Database
from forge_kit.events import OutboxEvent
from forge_preference_feedback.rounds import RlhfRounds, RoundReport
from forge_preference_feedback.seeds import read_hh_rlhf
from forge_preference_feedback.service import FeedbackService

if TYPE_CHECKING:
    from conftest import Clock

A, B, TIE = common_pb2.PREFERENCE_CHOICE_A, common_pb2.PREFERENCE_CHOICE_B, common_pb2.PREFERENCE_CHOICE_TIE


async def answer(service: FeedbackService, clock: Clock, rater: str, pick: str, count: int = 1000) -> None:
    for _ in range(count):
        item = await service.next_comparison(rater)
        if item is None:
            return
        clock.advance(10)
        gold = A if item.gold_choice == "A" else B
        choice = {"gold": gold, "flip": B if gold == A else A, "tie": TIE}[pick]
        await service.submit_preference(item.id, rater, choice, 1.0, "")


@pytest.fixture
async def rated(db: Database, clock: Clock, hh_root: Path) -> FeedbackService:
    service = FeedbackService(db, clock=clock, lease=dt.timedelta(seconds=60), overlap=5)
    await service.seed_comparisons(read_hh_rlhf(hh_root), limit=12, rng_seed=0)
    for rater in ("h1", "h2"):
        await answer(service, clock, rater, "gold")
    await answer(service, clock, "flipper", "flip")
    await answer(service, clock, "undecided", "tie")
    return service


@pytest.mark.asyncio
async def test_stats_count_accepted_pairs_and_those_after_a_watermark(
    rated: FeedbackService, clock: Clock
) -> None:
    stats = await rated.preference_stats()
    # Two honest raters x 12; the flipper is flagged, ties carry no preference.
    assert (stats.accepted, stats.accepted_since) == (24, 0)
    assert set(stats.excluded_raters) == {"flipper", "undecided"}
    assert stats.last_recorded_at is not None
    watermark = clock()
    await answer(rated, clock, "h3", "gold", count=3)
    later = await rated.preference_stats(watermark)
    assert (later.accepted, later.accepted_since) == (27, 3)


@pytest.mark.asyncio
async def test_the_same_data_is_one_snapshot_and_new_data_a_new_one(
    rated: FeedbackService, clock: Clock, tmp_path: Path
) -> None:
    first = await rated.export_to_store(tmp_path / "snapshots", heldout_fraction=0.25)
    assert first.created and first.path == tmp_path / "snapshots" / first.manifest.snapshot_id
    assert (first.path / "manifest.json").is_file()
    again = await rated.export_to_store(tmp_path / "snapshots", heldout_fraction=0.25)
    assert not again.created and again.path == first.path
    assert again.manifest.snapshot_id == first.manifest.snapshot_id
    assert sorted(p.name for p in (tmp_path / "snapshots").iterdir()) == [first.manifest.snapshot_id]
    await answer(rated, clock, "h3", "gold", count=2)
    newer = await rated.export_to_store(tmp_path / "snapshots", heldout_fraction=0.25)
    assert newer.created and newer.manifest.snapshot_id != first.manifest.snapshot_id
    assert newer.manifest.train_pairs + newer.manifest.test_pairs == 26


@pytest.mark.asyncio
async def test_rounds_are_updated_step_by_step_and_not_reopened(db: Database, clock: Clock) -> None:
    rounds = RlhfRounds(db, clock=clock)
    await rounds.record(RoundReport("rlhf-1", 1, "running", step="buffering"))
    clock.advance(5)
    await rounds.record(
        RoundReport(
            "rlhf-1", 1, "running", step="training reward model", snapshot_id="snap-1", metrics={"n": 3}
        )
    )
    clock.advance(5)
    row = await rounds.record(
        RoundReport("rlhf-1", 1, "rejected", reason="does not beat 50%", metrics={"rm_accuracy": 0.52})
    )
    assert (row.status, row.step, row.snapshot_id) == ("rejected", "training reward model", "snap-1")
    assert row.metrics == {"n": 3.0, "rm_accuracy": 0.52}
    assert row.updated_at - row.started_at == dt.timedelta(seconds=10)
    with pytest.raises(errors.ConflictError):
        await rounds.record(RoundReport("rlhf-1", 1, "running"))
    clock.advance(1)
    await rounds.record(RoundReport("rlhf-2", 1, "running"))
    listed, total = await rounds.list("", 10, 0)
    assert total == 2 and [r.workflow_id for r in listed] == ["rlhf-2", "rlhf-1"]
    # Every accepted report published the round as stored; the refused one published nothing.
    async with db.session() as session:
        rows = (await session.scalars(sa.select(OutboxEvent).order_by(OutboxEvent.sequence))).all()
    assert {r.topic for r in rows} == {"forge.feedback.rlhf_round_updated.v1"}
    published = [events_pb2.RlhfRoundUpdated.FromString(r.payload) for r in rows]
    assert [(e.workflow_id, e.round, e.status) for e in published] == [
        ("rlhf-1", 1, "running"),
        ("rlhf-1", 1, "running"),
        ("rlhf-1", 1, "rejected"),
        ("rlhf-2", 1, "running"),
    ]
    assert published[2].step == "training reward model" and published[2].reason == "does not beat 50%"
    assert dict(published[2].metrics) == {"n": 3.0, "rm_accuracy": 0.52}
    assert rows[2].key == b"rlhf-1/1"


@pytest.mark.parametrize(
    ("report", "field"),
    [
        (RoundReport("", 1, "running"), "round.workflow_id"),
        (RoundReport("w", 0, "running"), "round.round"),
        (RoundReport("w", 1, "paused"), "round.status"),
        (RoundReport("w", 1, "running", metrics={"kl": float("nan")}), "round.metrics.kl"),
    ],
)
@pytest.mark.asyncio
async def test_bad_round_reports_name_the_field(db: Database, report: RoundReport, field: str) -> None:
    with pytest.raises(errors.ValidationError) as caught:
        await RlhfRounds(db).record(report)
    assert caught.value.field == field
    assert await RlhfRounds(db).list("", 10, 0) == ([], 0)
    async with db.session() as session:
        assert await session.scalar(sa.select(sa.func.count()).select_from(OutboxEvent)) == 0


@pytest.mark.asyncio
async def test_the_rounds_page_shows_each_round_with_its_status_to_admins_only(
    db: Database, clock: Clock
) -> None:
    from argon2 import PasswordHasher

    from forge_kit.http import make_app
    from forge_preference_feedback.registry import RewardModelRegistry
    from forge_preference_feedback.web import rater_ui

    service = FeedbackService(
        db, clock=clock, hasher=PasswordHasher(time_cost=1, memory_cost=8, parallelism=1)
    )
    await service.create_rater("alice", "correct horse battery")
    await service.create_rater("boss", "correct horse battery", is_admin=True)
    rounds = RlhfRounds(db, clock=clock)
    await rounds.record(
        RoundReport(
            "rlhf-7",
            1,
            "rejected",
            step="reward model refused",
            snapshot_id="snap-abc",
            reward_model="rm:rlhf-7.r1",
            reason="held-out pairwise accuracy 0.520 does not beat 50% significantly",
            metrics={"rm_accuracy": 0.52},
        )
    )
    app = make_app("preference_feedback")
    app.include_router(
        rater_ui(
            service, RewardModelRegistry(db), secure_cookies=False, session_max_age_s=3600, rounds=rounds
        )
    )

    async def page_as(rater: str) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            login = await http.get("/ui/login")
            csrf = re.search(r'name="csrf" value="([^"]*)"', login.text)
            assert csrf
            await http.post(
                "/ui/login",
                data={"rater_id": rater, "password": "correct horse battery", "csrf": csrf.group(1)},
            )
            return await http.get("/ui/admin/rlhf")

    assert (await page_as("alice")).status_code == 403
    page = await page_as("boss")
    assert page.status_code == 200
    assert 'data-workflow="rlhf-7" data-round="1" data-status="rejected"' in page.text
    assert "does not beat 50% significantly" in page.text and "rm:rlhf-7.r1" in page.text
    assert "rm_accuracy=0.52" in page.text


@pytest.mark.asyncio
async def test_every_exported_pair_reads_back_as_a_pair_with_its_prompt(
    rated: FeedbackService, tmp_path: Path
) -> None:
    from collections import Counter

    from forge_training.rm.eval import read_pairs

    stored = await rated.export_to_store(tmp_path / "snapshots", heldout_fraction=0.25)
    skipped: Counter[str] = Counter()
    read = [p for split in ("train", "test") for p in read_pairs(stored.path / f"{split}.jsonl.gz", skipped)]
    assert not skipped and len(read) == stored.manifest.train_pairs + stored.manifest.test_pairs
    assert all(p.messages and p.messages[0][0] == "user" for p in read)


@pytest.mark.integration
@pytest.mark.asyncio
async def test_only_admins_export_snapshots_or_record_rounds_over_grpc(
    rated: FeedbackService, db: Database, tmp_path: Path
) -> None:
    import grpc
    from forge.feedback.v1 import feedback_pb2, feedback_pb2_grpc

    from forge_kit.grpckit import Principal, make_channel
    from forge_kit.testing.grpcserver import grpc_test_server
    from forge_preference_feedback.api import FeedbackApi
    from forge_preference_feedback.registry import RewardModelRegistry

    api = FeedbackApi(
        rated,
        RewardModelRegistry(db),
        max_page_size=50,
        rounds=RlhfRounds(db),
        snapshot_dir=tmp_path / "snaps",
    )
    async with grpc_test_server(
        feedback_pb2_grpc.add_PreferenceFeedbackServiceServicer_to_server,
        api,
        "forge.feedback.v1.PreferenceFeedbackService",
        token="admin-token",
        service="preference_feedback",
        authenticators=[lambda token: Principal("viewer", "team", "research") if token == "viewer" else None],
    ) as server:
        target = f"127.0.0.1:{server.port}"
        report = feedback_pb2.RecordRlhfRoundRequest(
            round=feedback_pb2.RlhfRound(workflow_id="rlhf-1", round=1, status="running", step="buffering")
        )
        async with make_channel(target, token="viewer") as channel:
            viewer = feedback_pb2_grpc.PreferenceFeedbackServiceStub(channel)
            for call in (
                viewer.ExportSnapshot(feedback_pb2.ExportSnapshotRequest()),
                viewer.RecordRlhfRound(report),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call
                assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
            stats = await viewer.GetPreferenceStats(feedback_pb2.GetPreferenceStatsRequest())
            assert stats.accepted_pairs == 24 and set(stats.excluded_raters) == {"flipper", "undecided"}
        async with make_channel(target, token="admin-token") as channel:
            admin = feedback_pb2_grpc.PreferenceFeedbackServiceStub(channel)
            made = await admin.ExportSnapshot(feedback_pb2.ExportSnapshotRequest(heldout_fraction=0.25))
            assert made.created and made.snapshot.uri == str(tmp_path / "snaps" / made.snapshot.snapshot_id)
            assert made.snapshot.train_pairs + made.snapshot.test_pairs == 24
            assert "anti-correlated" in made.snapshot.excluded_raters["flipper"]
            again = await admin.ExportSnapshot(feedback_pb2.ExportSnapshotRequest(heldout_fraction=0.25))
            assert not again.created and again.snapshot.snapshot_id == made.snapshot.snapshot_id
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await admin.ExportSnapshot(feedback_pb2.ExportSnapshotRequest(heldout_fraction=1.5))
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            stored = (await admin.RecordRlhfRound(report)).round
            assert (stored.workflow_id, stored.status, stored.step) == ("rlhf-1", "running", "buffering")
            listed = await admin.ListRlhfRounds(feedback_pb2.ListRlhfRoundsRequest(workflow_id="rlhf-1"))
            assert [r.round for r in listed.rounds] == [1]


def test_the_round_report_is_the_contracts_message_less_what_the_service_sets() -> None:
    """``RoundReport`` is this service's type of ``RlhfRound`` (the workflow has its own): a field
    added to the message must reach it (the service sets the timestamps)."""
    from dataclasses import fields

    from forge.feedback.v1 import feedback_pb2

    contract = {f.name for f in feedback_pb2.RlhfRound.DESCRIPTOR.fields} - {"started_at", "updated_at"}
    assert {f.name for f in fields(RoundReport)} == contract
