"""Preference feedback process: settings → database → optional seed → service → gRPC + HTTP servers."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from pathlib import Path

import uvloop
from forge.feedback.v1 import feedback_pb2, feedback_pb2_grpc

from forge_kit import errors
from forge_kit.app import ServiceApp
from forge_kit.paths import resolve_data_path
from forge_preference_feedback.api import FeedbackApi
from forge_preference_feedback.config import FeedbackSettings
from forge_preference_feedback.outbox import enable_pipelined_outbox
from forge_preference_feedback.quality import QualityPolicy
from forge_preference_feedback.registry import RewardModelRegistry
from forge_preference_feedback.rounds import RlhfRounds
from forge_preference_feedback.seeds import read_hh_rlhf
from forge_preference_feedback.service import FeedbackService
from forge_preference_feedback.transactions import open_transactions
from forge_preference_feedback.web import rater_api, rater_ui


async def main() -> None:
    settings = FeedbackSettings()
    app = ServiceApp(settings)
    db = await app.open_database("preference_feedback.db", Path(__file__).parent / "migrations")
    transactions = open_transactions(db, group_commit=settings.group_commit)
    app.add_on_stop(transactions.close)
    relay = enable_pipelined_outbox(app, transactions)
    service = FeedbackService(
        db,
        producer=app.name,
        lease=dt.timedelta(seconds=settings.assignment_lease_s),
        overlap=settings.overlap_k,
        session_ttl=dt.timedelta(seconds=settings.session_ttl_s),
        session_cache=dt.timedelta(seconds=settings.session_cache_s),
        on_commit=relay.wake if relay else lambda: None,
        transactions=transactions,
    )
    if settings.seed_dir:
        source = resolve_data_path(settings.seed_dir)
        seeded = await service.seed_comparisons(
            read_hh_rlhf(source), limit=settings.seed_limit, rng_seed=settings.seed_rng_seed
        )
        app.log.info(
            "feedback.seeded", source=str(source), added=seeded.added, already_present=seeded.already_present
        )
    if settings.admin_password.get_secret_value():
        with contextlib.suppress(errors.AlreadyExistsError):
            await service.create_rater("admin", settings.admin_password.get_secret_value(), is_admin=True)
    registry = RewardModelRegistry(db)
    rounds = RlhfRounds(db, producer=app.name)
    policy = QualityPolicy(min_median_seconds=settings.quality_min_median_seconds)
    api = FeedbackApi(
        service,
        registry,
        max_page_size=settings.max_page_size,
        rounds=rounds,
        snapshot_dir=Path(settings.snapshot_dir or Path(settings.data_dir, "snapshots")).resolve(),
        default_heldout_fraction=settings.default_heldout_fraction,
        policy=policy,
    )
    http = app.http_app()
    http.include_router(
        rater_ui(
            service,
            registry,
            secure_cookies=settings.secure_cookies,
            session_max_age_s=settings.session_ttl_s,
            policy=policy,
            rounds=rounds,
        )
    )
    http.include_router(rater_api(service, registry))
    await app.run(
        register=[
            lambda server: feedback_pb2_grpc.add_PreferenceFeedbackServiceServicer_to_server(api, server),
        ],
        service_names=[feedback_pb2.DESCRIPTOR.services_by_name["PreferenceFeedbackService"].full_name],
        http=http,
    )


if __name__ == "__main__":
    # uvloop: the event loop in C (sockets, timers, thread hand-offs), about a third less CPU
    # per request here; the service is single-threaded Python, so CPU per request is its rate.
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())
