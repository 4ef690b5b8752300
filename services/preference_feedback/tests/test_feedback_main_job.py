"""The ``forge up`` main-job step against a real gRPC server on the ``forge up`` data layout.

The simulated raters' pool is made smaller and quicker here (fewer answers, no dwell time); the
step's logic is the one ``forge up`` runs."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import sqlalchemy as sa
from forge.feedback.v1 import feedback_pb2_grpc

from forge_kit.db import Database
from forge_kit.testing.grpcserver import grpc_test_server
from forge_preference_feedback import main_job
from forge_preference_feedback.api import FeedbackApi
from forge_preference_feedback.main_job import PREFERENCES, RATER, RULE_LIMIT, SEED_LIMIT, step
from forge_preference_feedback.registry import RewardModelRegistry
from forge_preference_feedback.seeds import ASSISTANT, read_hh_rlhf
from forge_preference_feedback.service import FeedbackService
from forge_preference_feedback.store import ComparisonRow, PreferenceRow

pytestmark = [pytest.mark.integration]
MIGRATIONS = Path(__file__).parents[1] / "src" / "forge_preference_feedback" / "migrations"
TOKEN = "main-job-token"


@pytest.mark.parametrize("store", ["sqlite", "postgres"])
async def test_step_seeds_and_posts_each_preference_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, store: str, request: pytest.FixtureRequest
) -> None:
    """``sqlite``: `make up`'s layout; ``postgres``: `forge up --profile prod-like`, where the service's
    store is a PostgreSQL database the step must seed (the context names its URL)."""
    monkeypatch.setattr(main_job, "TARGET_ACCEPTED", 8)
    monkeypatch.setattr(main_job, "SIM_RATERS", 2)
    monkeypatch.setattr(main_job, "DWELL_S", 0.0)
    folder = tmp_path / "var" / "data" / "preference_feedback"
    folder.mkdir(parents=True)
    url = request.getfixturevalue("postgres_url") if store == "postgres" else ""
    db = Database(url or f"sqlite+aiosqlite:///{folder / 'preference_feedback.db'}")
    await db.migrate(MIGRATIONS)
    api = FeedbackApi(FeedbackService(db), RewardModelRegistry(db), max_page_size=10)
    async with grpc_test_server(
        feedback_pb2_grpc.add_PreferenceFeedbackServiceServicer_to_server,
        api,
        "forge.feedback.v1.PreferenceFeedbackService",
        token=TOKEN,
        service="preference_feedback",
    ) as server:
        endpoint = SimpleNamespace(grpc_target=f"127.0.0.1:{server.port}", token=TOKEN)
        ctx = SimpleNamespace(
            root=tmp_path,
            endpoint=lambda name: endpoint,
            database_urls={"preference_feedback": url} if url else {},
        )
        first = await step(ctx)
        again = await step(ctx)
    # The rule set's pairs that are usable comparisons (a few HH lines are not, e.g. mismatched turns).
    rule_dir = tmp_path / "var" / "data" / "preference_feedback" / "seeds" / main_job.RULE_NAME
    usable = sum(1 for _ in read_hh_rlhf(rule_dir))
    assert RULE_LIMIT - 5 <= usable <= RULE_LIMIT
    assert first == {
        "ok": True,
        "comparisons_added": SEED_LIMIT,
        "comparisons_present": SEED_LIMIT,
        "rule_comparisons_added": usable,
        "rule_comparisons_present": usable,
        "preferences_posted": PREFERENCES,
        "rater": RATER,
        "simulated_answers": 8 - PREFERENCES,
        "accepted_pairs": 8,
    }
    # Enough accepted pairs already: the second run posts only the retry demonstration.
    assert (again["comparisons_added"], again["rule_comparisons_added"]) == (0, 0)
    assert (again["preferences_posted"], again["simulated_answers"]) == (PREFERENCES, 0)
    assert again["accepted_pairs"] == 8 + PREFERENCES
    async with db.session() as session:
        rows = (await session.scalars(sa.select(PreferenceRow))).all()
        comparisons = {c.id: c for c in (await session.scalars(sa.select(ComparisonRow))).all()}
    await db.dispose()
    mine = [r for r in rows if r.rater_id == RATER]
    assert len(mine) == 2 * PREFERENCES and len({r.comparison_id for r in mine}) == 2 * PREFERENCES
    # The simulated raters answered the rule set (seeded first) with each item's preferred side.
    simulated = [r for r in rows if r.rater_id.startswith("sim-rater-")]
    assert len(simulated) == 8 - PREFERENCES and {r.rater_id for r in simulated} <= {
        "sim-rater-1",
        "sim-rater-2",
    }
    for row in simulated:
        item = comparisons[row.comparison_id]
        assert item.source == "hh-rlhf/full-stop-rule"
        preferred, other = (
            (item.response_a_text, item.response_b_text)
            if row.choice == 1
            else (item.response_b_text, item.response_a_text)
        )
        assert preferred.strip().endswith(".") and not other.strip().endswith(".")


def test_the_rule_set_prefers_the_response_that_ends_with_a_full_stop(tmp_path: Path) -> None:
    source = tmp_path / "hh.jsonl.gz"
    lines = [
        {"chosen": f"{ASSISTANT} No", "rejected": f"{ASSISTANT} Yes."},  # kept, swapped
        {"chosen": f"{ASSISTANT} Sure.", "rejected": f"{ASSISTANT} Fine."},  # both end with one
        {"chosen": f"{ASSISTANT} Ok.", "rejected": f"{ASSISTANT} Nope"},  # kept as is
        {"chosen": f"{ASSISTANT} A.", "rejected": f"{ASSISTANT} B"},  # over the limit
    ]
    with gzip.open(source, "wt") as sink:
        sink.writelines(json.dumps(line) + "\n" for line in lines)
    folder = main_job.write_rule_seed(source, tmp_path / "seeds", limit=2)
    with gzip.open(folder / "test.jsonl.gz", "rt") as written:
        rows = [json.loads(line) for line in written]
    assert [(r["chosen"], r["rejected"]) for r in rows] == [
        (f"{ASSISTANT} Yes.", f"{ASSISTANT} No"),
        (f"{ASSISTANT} Ok.", f"{ASSISTANT} Nope"),
    ]
    assert folder.name == main_job.RULE_NAME and not (folder / "test.jsonl.gz.partial").exists()
