"""Tables of the key lifecycle (``keys.service``): a tenant's API keys (only the SHA-256 of each is
kept, with a short prefix to recognise it by), their usage, and the audit log of every change."""

from __future__ import annotations

import datetime as dt

import sqlalchemy as sa
from sqlalchemy.orm import Mapped, mapped_column

from forge_kit.db import Base, utcnow


class ApiKeyRow(Base):
    """One API key of a tenant: its scopes, when it stops working, and what it was used for."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(sa.String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(sa.ForeignKey("tenants.id"), index=True)
    name: Mapped[str] = mapped_column(sa.String(63))
    prefix: Mapped[str] = mapped_column(sa.String(16))
    """The first characters of the secret (``fk-AbCd…``), enough to tell keys apart, never to use one."""
    key_hash: Mapped[str] = mapped_column(sa.String(64), unique=True)
    scopes: Mapped[str] = mapped_column(sa.String(255))
    """Space-separated scopes (``inference rag:read rag:write embeddings``)."""
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow)
    expires_at: Mapped[dt.datetime | None] = mapped_column(sa.DateTime, nullable=True)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(sa.DateTime, nullable=True)
    last_used_at: Mapped[dt.datetime | None] = mapped_column(sa.DateTime, nullable=True)
    rotated_from: Mapped[str] = mapped_column(sa.String(40), default="")
    requests: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    tokens: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    documents: Mapped[int] = mapped_column(sa.BigInteger, default=0)


class KeyAuditRow(Base):
    """One change to a tenant's keys: who did what, when."""

    __tablename__ = "api_key_audit"

    seq: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(sa.String(40), index=True)
    key_id: Mapped[str] = mapped_column(sa.String(40))
    action: Mapped[str] = mapped_column(sa.String(32))
    actor: Mapped[str] = mapped_column(sa.String(63))
    detail: Mapped[str] = mapped_column(sa.Text, default="{}")
    at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow)
