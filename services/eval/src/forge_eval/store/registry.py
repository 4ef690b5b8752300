"""Registry persistence: model versions with their lineage, and the stage events (the audit trail)."""

from __future__ import annotations

import datetime as dt

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Mapped, mapped_column

from forge_kit.db import Base, utcnow

CANDIDATE, CANARY, PRODUCTION, ARCHIVED = "candidate", "canary", "production", "archived"
STAGES = (CANDIDATE, CANARY, PRODUCTION, ARCHIVED)
#: Stages that serve traffic: one holder each, ``ModelPromoted`` on change, rollback possible.
SERVING = (CANARY, PRODUCTION)


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

    ``action`` is ``register``, ``promote``, ``archive`` or ``rollback``, or a guarded canary's
    ``extend``, ``pause`` or ``resume`` (with its analysis's ``evidence``, JSON); ``stage`` is the stage the
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
    evidence: Mapped[str] = mapped_column(sa.Text, default="")


async def find_model(session: AsyncSession, name: str, version: str) -> ModelRow | None:
    return await session.scalar(sa.select(ModelRow).where(ModelRow.name == name, ModelRow.version == version))


async def holders(session: AsyncSession) -> dict[str, StageEventRow]:
    """The current holder row of every serving stage: its newest promotion not rolled back whose
    model is still in that stage (a canary promoted to production no longer holds canary)."""
    rows = (
        await session.scalars(
            sa.select(StageEventRow)
            .join(ModelRow, ModelRow.id == StageEventRow.model_id)
            .where(
                StageEventRow.action == "promote",
                StageEventRow.rolled_back.is_(False),
                StageEventRow.stage == ModelRow.stage,
            )
            .order_by(StageEventRow.id)
        )
    ).all()
    return {row.stage: row for row in rows}
