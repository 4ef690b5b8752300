"""``forge up`` main-job step: real comparisons in, a few preferences posted through the API.

1. Seed comparisons from HH-RLHF into the service's database (idempotent; the same thing
   ``forge feedback seed`` does, into the ``forge up`` data folder).
2. As rater ``mainjob``, take comparisons with GetNextComparison and answer them with
   SubmitPreference over gRPC (the service's own token), posting each answer twice to show that
   a retry is recorded once.
"""

from __future__ import annotations

from typing import Any

from forge.common.v1 import common_pb2
from forge.feedback.v1 import feedback_pb2, feedback_pb2_grpc

from forge_kit.grpckit import make_channel
from forge_preference_feedback.cli import DEFAULT_SOURCE, seed_database
from forge_preference_feedback.config import FeedbackSettings
from forge_preference_feedback.seeds import ReadStats, resolve_data_path

SEED_LIMIT = 50
PREFERENCES = 3
RATER = "mainjob"


async def step(ctx: Any) -> dict[str, object]:
    """Seed, then post and re-post a few preferences; ``ok`` only if every retry matched."""
    # 1. Seed.
    endpoint = ctx.endpoint("preference_feedback")
    settings = FeedbackSettings(data_dir=str(ctx.root / "var" / "data" / "preference_feedback"))
    seeded = await seed_database(
        settings.sqlite_url("preference_feedback.db"),
        resolve_data_path(DEFAULT_SOURCE),
        SEED_LIMIT,
        0,
        ReadStats(),
    )
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
    return {
        "ok": True,
        "comparisons_added": seeded.added,
        "comparisons_present": seeded.added + seeded.already_present,
        "preferences_posted": len(recorded),
        "rater": RATER,
    }


step.order = 40  # type: ignore[attr-defined]
step.timeout_s = 120.0  # type: ignore[attr-defined]
