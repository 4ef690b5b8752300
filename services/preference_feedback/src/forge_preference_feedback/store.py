"""Preference feedback persistence: comparisons, assignments, preferences and reward models."""

from __future__ import annotations

import datetime as dt

import sqlalchemy as sa
from sqlalchemy.orm import Mapped, mapped_column

from forge_kit.db import Base


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(tzinfo=None)


class ComparisonRow(Base):
    """A comparison task: one prompt, two responses in the order raters see them.

    ``gold_choice`` records which side the source labelled better ("A"/"B", empty when unknown),
    for rater-quality checks; raters never see it.
    """

    __tablename__ = "feedback_comparisons"

    id: Mapped[str] = mapped_column(sa.String(40), primary_key=True)
    seq: Mapped[int] = mapped_column(sa.Integer, unique=True)
    source: Mapped[str] = mapped_column(sa.String(128))
    source_key: Mapped[str] = mapped_column(sa.String(255), unique=True)
    prompt: Mapped[str] = mapped_column(sa.Text)
    response_a_id: Mapped[str] = mapped_column(sa.String(40))
    response_a_text: Mapped[str] = mapped_column(sa.Text)
    response_a_model: Mapped[str] = mapped_column(sa.String(255), default="")
    response_b_id: Mapped[str] = mapped_column(sa.String(40))
    response_b_text: Mapped[str] = mapped_column(sa.Text)
    response_b_model: Mapped[str] = mapped_column(sa.String(255), default="")
    gold_choice: Mapped[str] = mapped_column(sa.String(1), default="")
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow)


class AssignmentRow(Base):
    """A comparison handed to a rater; reserved for them until ``expires_at``."""

    __tablename__ = "feedback_assignments"

    comparison_id: Mapped[str] = mapped_column(sa.ForeignKey("feedback_comparisons.id"), primary_key=True)
    rater_id: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    assigned_at: Mapped[dt.datetime] = mapped_column(sa.DateTime)
    expires_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, index=True)


class PreferenceRow(Base):
    """A rater's answer to a comparison; append-only, one per (comparison, rater)."""

    __tablename__ = "feedback_preferences"
    __table_args__ = (
        sa.UniqueConstraint("comparison_id", "rater_id", name="uq_feedback_preferences_comparison_rater"),
    )

    id: Mapped[str] = mapped_column(sa.String(40), primary_key=True)
    comparison_id: Mapped[str] = mapped_column(sa.ForeignKey("feedback_comparisons.id"), index=True)
    rater_id: Mapped[str] = mapped_column(sa.String(128), index=True)
    choice: Mapped[int] = mapped_column(sa.Integer)
    confidence: Mapped[float] = mapped_column(sa.Float)
    rationale: Mapped[str] = mapped_column(sa.Text, default="")
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow)
    shown_at: Mapped[dt.datetime | None] = mapped_column(sa.DateTime, nullable=True, default=None)
    """When the comparison was handed to the rater: ``created_at - shown_at`` is the time spent."""
    ui_version: Mapped[str] = mapped_column(sa.String(32), default="")
    """Which client recorded it (the web UI's version, or ``grpc``)."""


class RewardModelRow(Base):
    """A registered reward model version with its validation metrics."""

    __tablename__ = "feedback_reward_models"

    name: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    version: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    uri: Mapped[str] = mapped_column(sa.Text)
    metrics: Mapped[dict[str, float]] = mapped_column(sa.JSON, default=dict)
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow, index=True)
    status: Mapped[str] = mapped_column(sa.String(16), default="candidate")
    """``candidate`` when registered; an admin makes it ``active`` or ``retired`` (the only mutable field)."""


class RaterRow(Base):
    """A rater account; ``password_hash`` is an Argon2id hash (never the password)."""

    __tablename__ = "feedback_raters"

    id: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    password_hash: Mapped[str] = mapped_column(sa.String(255))
    is_admin: Mapped[bool] = mapped_column(sa.Boolean, default=False)
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow)


class SessionRow(Base):
    """A logged-in browser session. Only the SHA-256 of the cookie token is stored, so a copy of
    the database cannot be replayed as a login; ``csrf_token`` is the synchroniser token that
    every form of the session must carry."""

    __tablename__ = "feedback_sessions"

    token_hash: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    rater_id: Mapped[str] = mapped_column(sa.ForeignKey("feedback_raters.id"), index=True)
    csrf_token: Mapped[str] = mapped_column(sa.String(64))
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime)
    expires_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, index=True)
