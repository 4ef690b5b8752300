"""Preference feedback process: settings → database → optional seed → service → gRPC + HTTP servers."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from pathlib import Path

from forge.feedback.v1 import feedback_pb2, feedback_pb2_grpc

from forge_kit import errors
from forge_kit.app import ServiceApp
from forge_preference_feedback.api import FeedbackApi
from forge_preference_feedback.config import FeedbackSettings
from forge_preference_feedback.quality import QualityPolicy
from forge_preference_feedback.seeds import read_hh_rlhf, resolve_data_path
from forge_preference_feedback.service import FeedbackService
from forge_preference_feedback.web import rater_api, rater_ui


async def main() -> None:
    settings = FeedbackSettings()
    app = ServiceApp(settings)
    db = await app.open_database("preference_feedback.db", Path(__file__).parent / "migrations")
    relay = app.enable_outbox()
    service = FeedbackService(
        db,
        producer=app.name,
        lease=dt.timedelta(seconds=settings.assignment_lease_s),
        overlap=settings.overlap_k,
        session_ttl=dt.timedelta(seconds=settings.session_ttl_s),
        on_commit=relay.wake if relay else lambda: None,
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
    api = FeedbackApi(service, max_page_size=settings.max_page_size)
    http = app.http_app()
    http.include_router(
        rater_ui(
            service,
            secure_cookies=settings.secure_cookies,
            session_max_age_s=settings.session_ttl_s,
            policy=QualityPolicy(min_median_seconds=settings.quality_min_median_seconds),
        )
    )
    http.include_router(rater_api(service))
    await app.run(
        register=[
            lambda server: feedback_pb2_grpc.add_PreferenceFeedbackServiceServicer_to_server(api, server)
        ],
        service_names=[feedback_pb2.DESCRIPTOR.services_by_name["PreferenceFeedbackService"].full_name],
        http=http,
    )


if __name__ == "__main__":
    asyncio.run(main())
