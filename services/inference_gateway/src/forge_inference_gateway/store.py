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


class UpstreamReplicaRow(Base):
    """A model-server replica added at run time; every gateway replica routes to the same set."""

    __tablename__ = "upstream_replicas"

    url: Mapped[str] = mapped_column(sa.String(512), primary_key=True)
    added_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow)
    token: Mapped[str] = mapped_column(sa.String(512), default="", server_default="")
    """The bearer token issued for this replica (empty: none); the gateway sends it only there."""
