"""Scheduler process: settings → database → service → gRPC + HTTP servers."""

from __future__ import annotations

import asyncio
from pathlib import Path

from forge.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

from forge_kit.app import ServiceApp
from forge_scheduler.api import SchedulerApi
from forge_scheduler.config import SchedulerSettings
from forge_scheduler.policy import PolicyConfig
from forge_scheduler.scheduling import SchedulingLoop
from forge_scheduler.service import SchedulerService


async def main() -> None:
    settings = SchedulerSettings()
    app = ServiceApp(settings)
    db = await app.open_database("scheduler.db", Path(__file__).parent / "migrations")
    relay = app.enable_outbox()
    service = SchedulerService(
        db,
        producer=app.name,
        on_commit=relay.wake if relay else lambda: None,
        watch_queue_size=settings.watch_queue_size,
    )
    await service.teams.load_tokens()
    loop = SchedulingLoop(
        service,
        PolicyConfig(preemption_grace_s=settings.preemption_grace_s),
        interval_s=settings.cycle_interval_s,
        node_lost_after_s=settings.node_lost_after_s,
        usage_half_life_s=settings.usage_half_life_s,
    )
    app.add_background(loop.run)
    api = SchedulerApi(
        service, heartbeat_interval_s=settings.heartbeat_interval_s, max_page_size=settings.max_page_size
    )
    await app.run(
        register=[lambda server: scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(api, server)],
        service_names=[scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name],
        authenticators=[service.teams.authenticate],
    )


if __name__ == "__main__":
    asyncio.run(main())
