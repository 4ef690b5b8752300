"""Gateway persistence: tenants (API keys stored as SHA-256 hashes), model aliases with their canary
split, and the model-server replicas added through the admin API."""

from __future__ import annotations

import datetime as dt

import sqlalchemy as sa
from sqlalchemy.orm import Mapped, mapped_column

from forge_kit.db import Base, utcnow


class TenantRow(Base):
    """A tenant: who is charged and rate-limited; only the hash of its API key is kept."""

    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(sa.String(40), primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(63), unique=True)
    key_hash: Mapped[str] = mapped_column(sa.String(64), unique=True)
    priority_class: Mapped[str] = mapped_column(sa.String(32))
    rpm_limit: Mapped[int] = mapped_column(sa.Integer)
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow)
    allow_training: Mapped[bool] = mapped_column(sa.Boolean, default=False, server_default=sa.false())
    """The tenant allowed its prompts to be used for training (RLHF prompt pool); off by default."""


class TrainingPromptRow(Base):
    """A production prompt of a tenant that allowed training (``TenantRow.allow_training``), for
    the RLHF prompt pool (``tenants/training_prompts.py``); one row per (tenant, prompt text)."""

    __tablename__ = "training_prompts"
    __table_args__ = (
        sa.UniqueConstraint("tenant_id", "prompt_hash", name="uq_training_prompts_tenant_hash"),
    )

    seq: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(sa.ForeignKey("tenants.id"), index=True)
    prompt_hash: Mapped[str] = mapped_column(sa.String(64))
    prompt: Mapped[str] = mapped_column(sa.Text)
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow)


class ModelAliasRow(Base):
    """``alias`` → a model version, set by ``ModelPromoted`` events (``forge-chat`` → production),
    and optionally a canary version that takes ``canary_weight`` percent of the alias's traffic."""

    __tablename__ = "model_aliases"

    alias: Mapped[str] = mapped_column(sa.String(255), primary_key=True)
    model_name: Mapped[str] = mapped_column(sa.String(255))
    model_version: Mapped[str] = mapped_column(sa.String(255), default="")
    stage: Mapped[str] = mapped_column(sa.String(63))
    source_event_id: Mapped[str] = mapped_column(sa.String(64), default="")
    updated_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow)
    canary_model_name: Mapped[str] = mapped_column(sa.String(255), default="")
    canary_model_version: Mapped[str] = mapped_column(sa.String(255), default="")
    canary_weight: Mapped[int] = mapped_column(sa.Integer, default=0)
    shadow_model_name: Mapped[str] = mapped_column(sa.String(255), default="", server_default="")
    shadow_model_version: Mapped[str] = mapped_column(sa.String(255), default="", server_default="")
    shadow_percent: Mapped[int] = mapped_column(sa.Integer, default=0, server_default="0")
    """Share of the alias's stable traffic also sent to the shadow model, its answer only stored."""
    source_at_ns: Mapped[int] = mapped_column(sa.BigInteger, default=0, server_default="0")
    """``occurred_at`` (ns) of the event that set the stable model (0: set by an admin)."""
    canary_at_ns: Mapped[int] = mapped_column(sa.BigInteger, default=0, server_default="0")
    """``occurred_at`` (ns) of the event that last set or ended the canary split."""
    previous_model_name: Mapped[str] = mapped_column(sa.String(255), default="", server_default="")
    previous_model_version: Mapped[str] = mapped_column(sa.String(255), default="", server_default="")
    """The stable model the alias named before this one: routed to while no replica serves the new
    one yet (:meth:`ReplicaPool.serving`)."""


class ShadowPairRow(Base):
    """A production request mirrored to the shadow model: both answers (for raters), the shadow's
    status and latency. ``request`` is the body as sent (JSON, cut to a bound)."""

    __tablename__ = "shadow_pairs"

    id: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=True)
    alias: Mapped[str] = mapped_column(sa.String(255), index=True)
    path: Mapped[str] = mapped_column(sa.String(64))
    request: Mapped[str] = mapped_column(sa.Text)
    production_model: Mapped[str] = mapped_column(sa.String(255))
    production_status: Mapped[int] = mapped_column(sa.Integer)
    production_answer: Mapped[str] = mapped_column(sa.Text)
    shadow_model: Mapped[str] = mapped_column(sa.String(255))
    shadow_status: Mapped[str] = mapped_column(sa.String(16))
    shadow_answer: Mapped[str] = mapped_column(sa.Text)
    shadow_ms: Mapped[float] = mapped_column(sa.Float)
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow)


class UpstreamReplicaRow(Base):
    """A model-server replica added at run time; every gateway replica routes to the same set."""

    __tablename__ = "upstream_replicas"

    url: Mapped[str] = mapped_column(sa.String(512), primary_key=True)
    added_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow)
    token: Mapped[str] = mapped_column(sa.String(512), default="", server_default="")
    """The bearer token issued for this replica (empty: none); the gateway sends it only there."""
