"""Preference feedback persistence: the tables, and the rating hot path's statements
(:class:`HotPath`), built once. How the hot path's units of work run as transactions is
:mod:`.transactions`.
"""

from __future__ import annotations

import datetime as dt
from typing import cast

import sqlalchemy as sa
from sqlalchemy.orm import Mapped, mapped_column

from forge_kit.db import Base, utcnow
from forge_kit.events import INSERT_OUTBOX_EVENT, SET_OUTBOX_PAYLOAD


class ComparisonRow(Base):
    """A comparison task: one prompt, two responses in the order raters see them.

    ``gold_choice`` records which side the source labelled better ("A"/"B", empty when unknown),
    for rater-quality checks; ``origin`` says where the pair comes from (``seed`` data, ``policy``
    samples of an online RLHF round, canary ``shadow`` pairs) and ``batch`` which round queued it.
    Raters never see any of the three: only admins do.
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
    origin: Mapped[str] = mapped_column(sa.String(16), default="seed", server_default="seed")
    batch: Mapped[str] = mapped_column(sa.String(128), default="", server_default="", index=True)
    answer_count: Mapped[int] = mapped_column(sa.Integer, default=0)
    """Preferences recorded for it, kept in the preference's transaction; with ``seq`` it is the
    index that assignment walks to find the next open item."""

    __table_args__ = (sa.Index("ix_feedback_comparisons_answer_count_seq", "answer_count", "seq"),)


class AssignmentRow(Base):
    """A comparison handed to a rater; reserved for them until ``expires_at``, which the rater's
    answer brings forward to the time of the answer (the row stays as the proof of assignment)."""

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
    """A registered reward-model version. Immutable but for ``status`` (and who changed it when):
    the registry has no other update path."""

    __tablename__ = "feedback_reward_models"

    name: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    version: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    uri: Mapped[str] = mapped_column(sa.Text)
    """Checkpoint location: object-store URI of the Hugging Face files."""
    metrics: Mapped[dict[str, float]] = mapped_column(sa.JSON, default=dict)
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow, index=True)
    status: Mapped[str] = mapped_column(sa.String(16), default="candidate", index=True)
    """``candidate`` when registered; an admin makes it ``active`` or ``retired``."""
    snapshot_id: Mapped[str] = mapped_column(sa.String(128), default="")
    """The training snapshot (``forge feedback export``) it was trained on."""
    backbone: Mapped[str] = mapped_column(sa.String(255), default="")
    heldout_accuracy: Mapped[float | None] = mapped_column(sa.Float, nullable=True, default=None)
    heldout_ci95_low: Mapped[float | None] = mapped_column(sa.Float, nullable=True, default=None)
    heldout_ci95_high: Mapped[float | None] = mapped_column(sa.Float, nullable=True, default=None)
    heldout_n: Mapped[int | None] = mapped_column(sa.Integer, nullable=True, default=None)
    heldout_interval: Mapped[str] = mapped_column(sa.String(16), default="")
    """How the interval was computed: ``wilson`` or ``bootstrap``."""
    registered_by: Mapped[str] = mapped_column(sa.String(128), default="")
    status_changed_at: Mapped[dt.datetime | None] = mapped_column(sa.DateTime, nullable=True, default=None)
    status_changed_by: Mapped[str] = mapped_column(sa.String(128), default="")


class RlhfRoundRow(Base):
    """One round of the orchestrator's RLHF workflow as it last reported it (``rounds.py``)."""

    __tablename__ = "feedback_rlhf_rounds"

    workflow_id: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    round: Mapped[int] = mapped_column(sa.Integer, primary_key=True)
    status: Mapped[str] = mapped_column(sa.String(16))
    """``running``, ``completed``, ``stopped``, ``rejected`` or ``stalled``."""
    step: Mapped[str] = mapped_column(sa.String(255), default="")
    snapshot_id: Mapped[str] = mapped_column(sa.String(128), default="")
    reward_model: Mapped[str] = mapped_column(sa.String(200), default="")
    """``name:version`` of the reward model the round is pinned to."""
    policy_uri: Mapped[str] = mapped_column(sa.Text, default="")
    reason: Mapped[str] = mapped_column(sa.Text, default="")
    metrics: Mapped[dict[str, float]] = mapped_column(sa.JSON, default=dict)
    started_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow, index=True)


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


COMPARISONS = cast(sa.Table, ComparisonRow.__table__)
ASSIGNMENTS = cast(sa.Table, AssignmentRow.__table__)
PREFERENCES = cast(sa.Table, PreferenceRow.__table__)


class HotPath:
    """The statements of the rating hot path, built once with bind parameters.

    Every item handed out and every answer runs these; built per call, SQLAlchemy would spend
    more time constructing each statement and computing its cache key than SQLite spends
    running it. Parameters: ``rid`` (the rater), ``cid`` (the comparison), ``now``, ``k`` (the overlap);
    an UPDATE may not name a parameter after a column.
    """

    _c, _a, _p = COMPARISONS.c, ASSIGNMENTS.c, PREFERENCES.c
    _mine = sa.exists().where(_p.comparison_id == _c.id, _p.rater_id == sa.bindparam("rid"))
    held = (
        sa.select(COMPARISONS)
        .join(ASSIGNMENTS, _a.comparison_id == _c.id)
        .where(_a.rater_id == sa.bindparam("rid"), _a.expires_at > sa.bindparam("now"), ~_mine)
        .order_by(_a.assigned_at, _c.seq)
        .limit(1)
    )
    """The rater's own live lease on an item they have not answered yet."""
    free = (
        sa.select(COMPARISONS)
        .where(
            _c.answer_count < sa.bindparam("k"),
            ~sa.exists().where(
                _a.comparison_id == _c.id,
                _a.rater_id != sa.bindparam("rid"),
                _a.expires_at > sa.bindparam("now"),
            ),
            ~_mine,
        )
        .order_by(_c.answer_count, _c.seq)
        .limit(1)
    )
    """The first open item (by answers, then seq) that no other rater holds a live lease on."""
    _holders = (
        sa.select(_a.comparison_id, sa.func.count().label("n"))
        .where(_a.rater_id != sa.bindparam("rid"), _a.expires_at > sa.bindparam("now"))
        .group_by(_a.comparison_id)
        .subquery()
    )
    held_by_others = (
        sa.select(COMPARISONS)
        .join(_holders, _holders.c.comparison_id == _c.id)
        .where(_c.answer_count + _holders.c.n < sa.bindparam("k"), ~_mine)
        .order_by(_holders.c.n, _c.answer_count, _c.seq)
        .limit(1)
    )
    """Among items other raters hold, one still under the overlap: fewest holders first."""
    renew_lease = (
        sa.update(ASSIGNMENTS)
        .where(_a.comparison_id == sa.bindparam("cid"), _a.rater_id == sa.bindparam("rid"))
        .values(assigned_at=sa.bindparam("lease_from"), expires_at=sa.bindparam("lease_until"))
    )
    insert_lease = sa.insert(ASSIGNMENTS)
    comparison = sa.select(COMPARISONS).where(_c.id == sa.bindparam("cid"))
    answer = sa.select(PREFERENCES).where(
        _p.comparison_id == sa.bindparam("cid"), _p.rater_id == sa.bindparam("rid")
    )
    lease = sa.select(_a.assigned_at, _a.expires_at).where(
        _a.comparison_id == sa.bindparam("cid"), _a.rater_id == sa.bindparam("rid")
    )
    insert_answer = sa.insert(PREFERENCES)
    end_lease = (
        sa.update(ASSIGNMENTS)
        .where(_a.comparison_id == sa.bindparam("cid"), _a.rater_id == sa.bindparam("rid"))
        .values(expires_at=sa.bindparam("lease_until"))
    )
    count_answer = (
        sa.update(COMPARISONS).where(_c.id == sa.bindparam("cid")).values(answer_count=_c.answer_count + 1)
    )
    # The kit's stage_event_sync statements, so that staging an event runs precompiled too.
    insert_event = INSERT_OUTBOX_EVENT
    event_payload = SET_OUTBOX_PAYLOAD

    @classmethod
    def statements(cls) -> list[sa.Executable]:
        """Every statement above (what :class:`PrecompiledConnection` compiles once)."""
        return [v for k, v in vars(cls).items() if not k.startswith("_") and isinstance(v, sa.Executable)]
