"""``forge up`` main-job step: real comparisons in, preferences posted through the API.

1. Seed comparisons (idempotent; what ``forge feedback seed`` does, into the ``forge up`` data
   folder): first the **full-stop rule** set, then HH-RLHF as it is. The rule set is HH-RLHF
   helpful-base pairs in which exactly one final response ends with a full stop, that one marked
   as the preferred side (source ``hh-rlhf/full-stop-rule``). With the policy samples the
   orchestrator's online ``rlhf`` step has raters answer, it is the data of that round's reward
   model (its snapshot holds every accepted pair): a preference a tiny CPU reward model learns in seconds
   from a hundred pairs, where real HH-RLHF labels need thousands (the same data the
   orchestrator's RLHF tests use). Seeded first, so a fresh database hands it out first.
2. As rater ``mainjob``, take comparisons with GetNextComparison and answer them with
   SubmitPreference over gRPC (the service's own token), posting each answer twice to show that
   a retry is recorded once.
3. A pool of simulated raters (``sim-rater-<n>``, concurrently) answers comparisons over the same
   API with each comparison's source preference (the rule for rule items, the human label for
   HH-RLHF ones) until the service counts :data:`TARGET_ACCEPTED` accepted pairs. Each takes
   :data:`DWELL_S` per item, as a reader would: the service's rater-quality rules (too fast,
   agreement, gold accuracy) judge them like anyone else, and a flagged rater's labels would be
   left out of the round's snapshot.
"""

from __future__ import annotations

import asyncio
import gzip
import json
from pathlib import Path
from typing import Any

from forge.common.v1 import common_pb2
from forge.feedback.v1 import feedback_pb2, feedback_pb2_grpc

from forge_kit.db import Database
from forge_kit.grpckit import make_channel
from forge_kit.paths import resolve_data_path
from forge_preference_feedback.cli import DEFAULT_SOURCE, seed_database
from forge_preference_feedback.config import FeedbackSettings
from forge_preference_feedback.seeds import ASSISTANT, ReadStats
from forge_preference_feedback.service import FeedbackService

SEED_LIMIT = 50
PREFERENCES = 3
RATER = "mainjob"
RULE_SOURCE = "helpful-base/test.jsonl.gz"
RULE_NAME = "full-stop-rule"
RULE_LIMIT = 200
#: Accepted pairs the simulated raters top the service up to (the seed part of the RLHF step's snapshot).
TARGET_ACCEPTED = 144
SIM_RATERS = 12
#: Seconds a simulated rater spends on an item; above the service's 3 s "too fast" threshold.
DWELL_S = 3.2
CHOICES = {"A": common_pb2.PREFERENCE_CHOICE_A, "B": common_pb2.PREFERENCE_CHOICE_B}


def _last_turn(transcript: str) -> str:
    return transcript.rsplit(ASSISTANT, 1)[-1].strip()


def write_rule_seed(source: Path, out: Path, limit: int) -> Path:
    """``out/<RULE_NAME>/test.jsonl.gz``: up to ``limit`` pairs of ``source`` (HH-RLHF lines) whose
    final responses differ in ending with a full stop, the one that does as ``chosen``. Written
    once (a temporary file renamed), so every run seeds the same pairs."""
    folder = out / RULE_NAME
    target = folder / "test.jsonl.gz"
    if target.is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / "test.jsonl.gz.partial"
    kept = 0
    with (
        gzip.open(source, "rt", encoding="utf-8") as lines,
        gzip.open(partial, "wt", encoding="utf-8") as sink,
    ):
        for line in lines:
            row = json.loads(line)
            a, b = _last_turn(row["chosen"]), _last_turn(row["rejected"])
            if a.endswith(".") == b.endswith("."):
                continue
            chosen, rejected = (
                (row["chosen"], row["rejected"]) if a.endswith(".") else (row["rejected"], row["chosen"])
            )
            sink.write(json.dumps({"chosen": chosen, "rejected": rejected}) + "\n")
            kept += 1
            if kept == limit:
                break
    partial.rename(target)
    return folder


async def _accepted(stub: Any) -> int:
    reply = await stub.GetPreferenceStats(feedback_pb2.GetPreferenceStatsRequest(), timeout=30)
    return int(reply.accepted_pairs)


async def _simulated_rater(stub: Any, service: FeedbackService, rater: str, budget: list[int]) -> int:
    """Answer comparisons with their source preference while the shared budget lasts."""
    answered = 0
    while budget[0] > 0:
        budget[0] -= 1
        reply = await stub.GetNextComparison(
            feedback_pb2.GetNextComparisonRequest(rater_id=rater), timeout=10
        )
        if not reply.HasField("comparison"):
            break
        gold = (await service.get_comparison(reply.comparison.id)).gold_choice
        # An item with no source preference (not seeded) gets a tie: no pair for training.
        choice = CHOICES.get(gold, common_pb2.PREFERENCE_CHOICE_TIE)
        await asyncio.sleep(DWELL_S)
        await stub.SubmitPreference(
            feedback_pb2.SubmitPreferenceRequest(
                comparison_id=reply.comparison.id, rater_id=rater, choice=choice, confidence=0.9
            ),
            timeout=10,
        )
        answered += 1
    return answered


async def step(ctx: Any) -> dict[str, object]:
    """Seed, post and re-post a few preferences, then top accepted pairs up to the RLHF round's
    need; ``ok`` only if every retry matched."""
    # 1. Seed: the rule set first, then HH-RLHF.
    endpoint = ctx.endpoint("preference_feedback")
    settings = FeedbackSettings(data_dir=str(ctx.root / "var" / "data" / "preference_feedback"))
    # The service's own store: PostgreSQL under `forge up --profile prod-like`, else its SQLite file.
    database_url = ctx.database_urls.get("preference_feedback") or settings.sqlite_url(
        "preference_feedback.db"
    )
    hh = resolve_data_path(DEFAULT_SOURCE)
    rule_dir = await asyncio.to_thread(
        write_rule_seed, hh / RULE_SOURCE, Path(settings.data_dir) / "seeds", RULE_LIMIT
    )
    rule = await seed_database(database_url, rule_dir, RULE_LIMIT, 0, ReadStats())
    seeded = await seed_database(database_url, hh, SEED_LIMIT, 0, ReadStats())
    # 2. Rate through the API.
    recorded: list[str] = []
    async with make_channel(endpoint.grpc_target, token=endpoint.token) as channel:
        stub = feedback_pb2_grpc.PreferenceFeedbackServiceStub(channel)
        for n in range(PREFERENCES):
            reply = await stub.GetNextComparison(
                feedback_pb2.GetNextComparisonRequest(rater_id=RATER), timeout=10
            )
            if not reply.HasField("comparison"):
                break
            request = feedback_pb2.SubmitPreferenceRequest(
                comparison_id=reply.comparison.id,
                rater_id=RATER,
                choice=common_pb2.PREFERENCE_CHOICE_A if n % 2 == 0 else common_pb2.PREFERENCE_CHOICE_B,
                confidence=1.0,
            )
            first = await stub.SubmitPreference(request, timeout=10)
            again = await stub.SubmitPreference(request, timeout=10)
            if first.preference_id != again.preference_id:
                return {
                    "ok": False,
                    "error": f"retry recorded twice: {first.preference_id} {again.preference_id}",
                }
            recorded.append(first.preference_id)
        # 3. Simulated raters, until the accepted pairs reach the target.
        before = await _accepted(stub)
        budget = [max(0, TARGET_ACCEPTED - before)]
        db = Database(database_url)
        try:
            service = FeedbackService(db)
            answers = await asyncio.gather(
                *(_simulated_rater(stub, service, f"sim-rater-{i + 1}", budget) for i in range(SIM_RATERS))
            )
        finally:
            await db.dispose()
        accepted = await _accepted(stub)
    return {
        "ok": True,
        "comparisons_added": seeded.added,
        "comparisons_present": seeded.added + seeded.already_present,
        "rule_comparisons_added": rule.added,
        "rule_comparisons_present": rule.added + rule.already_present,
        "preferences_posted": len(recorded),
        "rater": RATER,
        "simulated_answers": sum(answers),
        "accepted_pairs": accepted,
    }


step.order = 40  # type: ignore[attr-defined]
step.timeout_s = 240.0  # type: ignore[attr-defined]
