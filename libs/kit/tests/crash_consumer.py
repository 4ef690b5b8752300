"""Run by test_events.py as a subprocess: consume, commit the handler's transaction, then die by
SIGKILL before the Kafka offset is committed — the crash the idempotent consumer must survive."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import sqlalchemy as sa
from google.protobuf.message import Message
from sqlalchemy.ext.asyncio import AsyncSession

from forge_kit.consumer import EventConsumer
from forge_kit.db import Database
from forge_kit.testing import eventkeys


async def main(bootstrap: str, db_url: str, group: str, topic: str, job_id: str) -> None:
    db = Database(db_url)

    async def handler(event: Message, session: AsyncSession) -> None:
        if getattr(event, "job_id", "") == job_id:
            await session.execute(
                sa.text("UPDATE counters SET n = n + 1 WHERE name = :name"), {"name": job_id}
            )

    consumer = EventConsumer(
        db,
        bootstrap=bootstrap,
        group_id=group,
        topics=[topic],
        handler=handler,
        session_timeout_ms=1500,
        verifier=eventkeys.verifier(),
    )
    apply = consumer.handle

    async def apply_then_crash(record):  # type: ignore[no-untyped-def]
        applied = await apply(record)  # the handler's transaction has committed here
        event = consumer_event_job(record)
        if applied and event == job_id:
            os.kill(os.getpid(), signal.SIGKILL)  # before run() commits the offset
        return applied

    def consumer_event_job(record):  # type: ignore[no-untyped-def]
        from forge_kit.events import HEADER_TYPE, decode_event

        headers = {k: v.decode() for k, v in (record.headers or ())}
        return getattr(decode_event(headers[HEADER_TYPE], record.value), "job_id", "")

    consumer.handle = apply_then_crash  # type: ignore[method-assign]
    await consumer.run()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:6]))
