"""A deliberately broken build, for the fault suite only: a service started with this folder on
``PYTHONPATH`` runs an outbox relay that marks its rows published *before* the broker has
acknowledged them, then sends (the bug the history checker must catch: a crash or a partition
before the acknowledgement loses the records for good). Nothing outside tests/faults imports it."""

from __future__ import annotations

import sqlalchemy as sa

import forge_kit.outbox as outbox
from forge_kit.db import utcnow
from forge_kit.events import Record


async def relay_once_marking_first(self: outbox.OutboxRelay) -> int:
    async with self._db.session() as session:
        rows = (
            await session.execute(
                sa.select(outbox.OUTBOX.c.sequence, outbox.OUTBOX.c.topic, outbox.OUTBOX.c.key)
                .add_columns(outbox.OUTBOX.c.event_type, outbox.OUTBOX.c.event_id, outbox.OUTBOX.c.payload)
                .where(outbox.OUTBOX.c.published_at.is_(None))
                .order_by(outbox.OUTBOX.c.sequence)
                .limit(self._batch_size)
            )
        ).all()
    if not rows:
        return 0
    await self._mark_published([r.sequence for r in rows], utcnow())  # the bug: before the ack
    records = [
        Record(r.topic, r.payload, r.key, self._signer.headers(r.topic, r.event_type, r.event_id, r.payload))
        for r in rows
    ]
    _acked, error = await self._publisher.send_batch(records)
    if error is not None:
        raise error
    return len(rows)


outbox.OutboxRelay.relay_once = relay_once_marking_first  # type: ignore[method-assign]
