"""Orchestrator persistence: the job events it received and routed to workflows, and the MLflow
run of each tracked training job."""

from __future__ import annotations

import datetime as dt

import sqlalchemy as sa
from sqlalchemy.orm import Mapped, mapped_column

from forge_kit.db import Base, utcnow


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


class TrackedRunRow(Base):
    """The MLflow run of one scheduler job, as the tracking consumer made it."""

    __tablename__ = "tracked_runs"

    job_id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    mlflow_run_id: Mapped[str] = mapped_column(sa.String(64))
    training_run_id: Mapped[str] = mapped_column(sa.String(255), default="", index=True)
    """The trainer's run id (from ``TrainingMetrics`` / ``CheckpointPublished``)."""
    final_state: Mapped[str] = mapped_column(sa.String(32), default="")
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow)
