"""The kit's outbox relay (:class:`forge_kit.outbox.OutboxRelay`, pipelined) tuned for this
service: raters' preferences arrive faster than one batch a commit, so batches are larger and
start at most every 10 ms, and rows are marked published through the service's
:class:`Transactions` — on SQLite one more unit in the writer thread's group commit rather than
a second writer contending for the lock."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

from forge_kit.app import ServiceApp
from forge_kit.outbox import OutboxRelay, mark_published_statement
from forge_preference_feedback.transactions import Transactions, UnitConnection

BATCH_SIZE = 500
MIN_INTERVAL_S = 0.01


def enable_pipelined_outbox(app: ServiceApp, transactions: Transactions) -> OutboxRelay | None:
    """``ServiceApp.enable_outbox`` with this service's batching and marking (None when Kafka is
    off); the app serves the EventLogService (consumers catch up from the outbox) either way."""

    async def mark_published(sequences: Sequence[int], when: dt.datetime) -> None:
        def mark(conn: UnitConnection) -> None:
            conn.execute(mark_published_statement(sequences, when))

        await transactions.run(mark)

    return app.enable_outbox(
        batch_size=BATCH_SIZE, min_interval_s=MIN_INTERVAL_S, mark_published=mark_published
    )
