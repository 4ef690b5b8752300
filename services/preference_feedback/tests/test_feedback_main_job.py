"""The ``forge up`` main-job step against a real gRPC server on the ``forge up`` data layout."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import sqlalchemy as sa
from forge.feedback.v1 import feedback_pb2_grpc

from forge_kit.db import Database
from forge_kit.grpckit import serve
from forge_preference_feedback.api import FeedbackApi
from forge_preference_feedback.main_job import PREFERENCES, RATER, SEED_LIMIT, step
from forge_preference_feedback.registry import RewardModelRegistry
from forge_preference_feedback.service import FeedbackService
from forge_preference_feedback.store import PreferenceRow

pytestmark = [pytest.mark.asyncio, pytest.mark.integration]
MIGRATIONS = Path(__file__).parents[1] / "src" / "forge_preference_feedback" / "migrations"
TOKEN = "main-job-token"


async def test_step_seeds_and_posts_each_preference_once(tmp_path: Path) -> None:
    folder = tmp_path / "var" / "data" / "preference_feedback"
    folder.mkdir(parents=True)
    db = Database(f"sqlite+aiosqlite:///{folder / 'preference_feedback.db'}")
    await db.migrate(MIGRATIONS)
    api = FeedbackApi(FeedbackService(db), RewardModelRegistry(db), max_page_size=10)
    server = await serve(
        service="preference_feedback",
        register=[lambda s: feedback_pb2_grpc.add_PreferenceFeedbackServiceServicer_to_server(api, s)],
        service_names=["forge.feedback.v1.PreferenceFeedbackService"],
        host="127.0.0.1",
        port=0,
        token=TOKEN,
        default_deadline_s=5,
    )
    endpoint = SimpleNamespace(grpc_target=f"127.0.0.1:{server.port}", token=TOKEN)
    ctx = SimpleNamespace(root=tmp_path, endpoint=lambda name: endpoint)
    try:
        first = await step(ctx)
        again = await step(ctx)
    finally:
        await server.stop(0)
    assert first == {
        "ok": True,
        "comparisons_added": SEED_LIMIT,
        "comparisons_present": SEED_LIMIT,
        "preferences_posted": PREFERENCES,
        "rater": RATER,
    }
    assert (again["comparisons_added"], again["preferences_posted"]) == (0, PREFERENCES)
    async with db.session() as session:
        rows = (await session.scalars(sa.select(PreferenceRow))).all()
    await db.dispose()
    assert len(rows) == 2 * PREFERENCES and len({r.comparison_id for r in rows}) == 2 * PREFERENCES
