"""Orchestrator persistence: the job events it received and routed to workflows."""

from __future__ import annotations

import datetime as dt

import sqlalchemy as sa
from sqlalchemy.orm import Mapped, mapped_column

from forge_kit.db import Base


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(tzinfo=None)


class JobEventRow(Base):
    """A ``JobStateChanged`` event for a job a workflow started, as delivered to that workflow."""

    __tablename__ = "job_events"

    event_id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    job_id: Mapped[str] = mapped_column(sa.String(64), index=True)
    workflow_id: Mapped[str] = mapped_column(sa.String(255), index=True)
    state: Mapped[str] = mapped_column(sa.String(32))
    auto_eval: Mapped[bool] = mapped_column(sa.Boolean, default=True, server_default=sa.true())
    """False when the job is labelled ``auto_eval=false``: its checkpoints start no eval-and-promote."""
    received_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow)
