"""Alembic operations for the tables every service database has (outbox, processed events,
dead letters). A service's first migration calls :func:`create_kit_tables`."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


def create_kit_tables() -> None:
    """Create ``forge_outbox``, ``forge_processed_events`` and ``forge_dead_letters``."""
    op.create_table(
        "forge_outbox",
        sa.Column("sequence", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("event_id", sa.String(64), nullable=False, unique=True),
        sa.Column("topic", sa.String(255), nullable=False),
        sa.Column("key", sa.LargeBinary, nullable=True),
        sa.Column("event_type", sa.String(255), nullable=False),
        sa.Column("payload", sa.LargeBinary, nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.Column("published_at", sa.DateTime, nullable=True),
    )
    op.create_index("ix_forge_outbox_published_at", "forge_outbox", ["published_at"])
    op.create_table(
        "forge_processed_events",
        sa.Column("consumer_group", sa.String(255), primary_key=True),
        sa.Column("event_id", sa.String(64), primary_key=True),
        sa.Column("topic", sa.String(255), nullable=False),
        sa.Column("processed_at", sa.DateTime, nullable=False),
    )
    op.create_table(
        "forge_dead_letters",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("consumer_group", sa.String(255), nullable=False),
        sa.Column("topic", sa.String(255), nullable=False),
        sa.Column("partition", sa.Integer, nullable=False),
        sa.Column("offset", sa.BigInteger, nullable=False),
        sa.Column("event_type", sa.String(255), nullable=False),
        sa.Column("payload", sa.LargeBinary, nullable=False),
        sa.Column("error", sa.Text, nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
    )


def drop_kit_tables() -> None:
    """Reverse of :func:`create_kit_tables`."""
    op.drop_table("forge_dead_letters")
    op.drop_table("forge_processed_events")
    op.drop_index("ix_forge_outbox_published_at", "forge_outbox")
    op.drop_table("forge_outbox")


def create_catchup_table() -> None:
    """``forge_catchup_watermarks``: for services that catch up from producers' outboxes."""
    op.create_table(
        "forge_catchup_watermarks",
        sa.Column("consumer_group", sa.String(255), primary_key=True),
        sa.Column("producer", sa.String(255), primary_key=True),
        sa.Column("sequence", sa.BigInteger, nullable=False),
    )


def drop_catchup_table() -> None:
    op.drop_table("forge_catchup_watermarks")
