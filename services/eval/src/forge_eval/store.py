"""Eval persistence: registered models, stage history, runs, metrics and per-example results."""

from __future__ import annotations

import datetime as dt

import sqlalchemy as sa
from sqlalchemy.orm import Mapped, mapped_column

from forge_kit.db import Base


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(tzinfo=None)


class ModelRow(Base):
    """A model version in the registry: where its files are and how it was labelled."""

    __tablename__ = "eval_models"
    __table_args__ = (sa.UniqueConstraint("name", "version", name="uq_eval_models_name_version"),)

    id: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(sa.String(128), index=True)
    version: Mapped[str] = mapped_column(sa.String(64))
    uri: Mapped[str] = mapped_column(sa.Text)
    labels: Mapped[dict[str, str]] = mapped_column(sa.JSON, default=dict)
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow)
    stage: Mapped[str] = mapped_column(sa.String(16), default="candidate")
    """Lifecycle stage: ``candidate`` → ``canary`` → ``production`` → ``archived``."""
    training_run_id: Mapped[str] = mapped_column(sa.String(128), default="", index=True)
    recipe_hash: Mapped[str] = mapped_column(sa.String(128), default="")
    data_hash: Mapped[str] = mapped_column(sa.String(128), default="")
    parent_model_id: Mapped[int | None] = mapped_column(sa.ForeignKey("eval_models.id"), nullable=True)


class StageEventRow(Base):
    """One registry change, append-only: the audit trail and the rollback stack.

    ``action`` is ``register``, ``promote``, ``archive`` or ``rollback``; ``stage`` is the stage the
    model moved to and ``from_stage`` the one it left. A serving stage's holder is the newest
    ``promote`` row of the stage not yet ``rolled_back`` whose model is still in that stage; a
    rollback marks the holder's rows rolled back and writes a ``rollback`` row naming the model it
    restored. ``actor`` is who asked; ``forced`` promotions skipped a failing gate, and
    ``gate_report`` keeps that gate's state (JSON) as it was.
    """

    __tablename__ = "eval_stage_events"

    id: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=True)
    stage: Mapped[str] = mapped_column(sa.String(64), index=True)
    action: Mapped[str] = mapped_column(sa.String(16))
    model_id: Mapped[int] = mapped_column(sa.ForeignKey("eval_models.id"))
    previous_model_id: Mapped[int | None] = mapped_column(sa.ForeignKey("eval_models.id"), nullable=True)
    traffic_percent: Mapped[int] = mapped_column(sa.Integer, default=100)
    reason: Mapped[str] = mapped_column(sa.Text, default="")
    gate_run_id: Mapped[str] = mapped_column(sa.String(40), default="")
    rolled_back: Mapped[bool] = mapped_column(sa.Boolean, default=False)
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow)
    from_stage: Mapped[str] = mapped_column(sa.String(16), default="")
    actor: Mapped[str] = mapped_column(sa.String(128), default="")
    forced: Mapped[bool] = mapped_column(sa.Boolean, default=False)
    gate_report: Mapped[str] = mapped_column(sa.Text, default="")


class RunRow(Base):
    """An eval run; ``spec`` is the pinned run spec whose canonical JSON ``spec_hash`` hashes."""

    __tablename__ = "eval_runs"

    id: Mapped[str] = mapped_column(sa.String(40), primary_key=True)
    suite: Mapped[str] = mapped_column(sa.String(64), index=True)
    model_name: Mapped[str] = mapped_column(sa.String(128), index=True)
    model_version: Mapped[str] = mapped_column(sa.String(64))
    endpoint: Mapped[str] = mapped_column(sa.Text, default="")
    spec: Mapped[dict[str, object]] = mapped_column(sa.JSON)
    spec_hash: Mapped[str] = mapped_column(sa.String(64), index=True)
    status: Mapped[int] = mapped_column(sa.Integer, index=True)
    error: Mapped[str] = mapped_column(sa.Text, default="")
    example_count: Mapped[int] = mapped_column(sa.Integer, default=0)
    passed_gate: Mapped[bool] = mapped_column(sa.Boolean, default=False)
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow, index=True)
    started_at: Mapped[dt.datetime | None] = mapped_column(sa.DateTime, nullable=True)
    finished_at: Mapped[dt.datetime | None] = mapped_column(sa.DateTime, nullable=True)
    tier: Mapped[str] = mapped_column(sa.String(16), default="full")
    serve_model: Mapped[bool] = mapped_column(sa.Boolean, default=False)
    """Eval starts a model server from the model's registered checkpoint for the run."""
    report_path: Mapped[str] = mapped_column(sa.Text, default="")


class MetricRow(Base):
    """A run's aggregate metric with its 95% interval."""

    __tablename__ = "eval_run_metrics"

    run_id: Mapped[str] = mapped_column(sa.ForeignKey("eval_runs.id", ondelete="CASCADE"), primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    value: Mapped[float] = mapped_column(sa.Float)
    ci_low: Mapped[float] = mapped_column(sa.Float)
    ci_high: Mapped[float] = mapped_column(sa.Float)
    n: Mapped[int] = mapped_column(sa.Integer)


class ExampleRow(Base):
    """One example's score for one metric, with what the model said (paired comparisons use these)."""

    __tablename__ = "eval_run_examples"

    run_id: Mapped[str] = mapped_column(sa.ForeignKey("eval_runs.id", ondelete="CASCADE"), primary_key=True)
    example_id: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    metric: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    score: Mapped[float] = mapped_column(sa.Float)
    prompt: Mapped[str] = mapped_column(sa.Text, default="")
    output: Mapped[str] = mapped_column(sa.Text, default="")
    extracted: Mapped[str] = mapped_column(sa.Text, default="")
    target: Mapped[str] = mapped_column(sa.Text, default="")
