"""Run persistence: eval runs with their pinned specs, aggregate metrics and per-example results."""

from __future__ import annotations

import datetime as dt
import enum
from collections import defaultdict

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Mapped, mapped_column

from forge_kit import errors
from forge_kit.db import Base, utcnow


class RunStatus(enum.IntEnum):
    """A run's state as :attr:`RunRow.status` stores it (the numbers of ``forge.eval.v1.RunStatus``;
    nothing cancels a run yet)."""

    PENDING = 1
    RUNNING = 2
    SUCCEEDED = 3
    FAILED = 4
    CANCELLED = 5


def status_name(status: int) -> str:
    return RunStatus(status).name


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


async def get_run(session: AsyncSession, run_id: str) -> RunRow:
    if not run_id:
        raise errors.ValidationError("run_id", "must not be empty")
    run = await session.get(RunRow, run_id)
    if run is None:
        raise errors.NotFoundError(f"run {run_id!r} not found")
    return run


async def example_scores(session: AsyncSession, run_id: str) -> dict[str, dict[str, float]]:
    """A finished run's scores: metric → example id → score."""
    scores: dict[str, dict[str, float]] = defaultdict(dict)
    rows = await session.execute(
        sa.select(ExampleRow.metric, ExampleRow.example_id, ExampleRow.score).where(
            ExampleRow.run_id == run_id
        )
    )
    for metric, example_id, score in rows:
        scores[metric][example_id] = score
    return scores
