"""Scheduler persistence: teams, quotas, jobs and nodes (SQLAlchemy 2, one database)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Mapped, mapped_column

from forge_kit.db import Base


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(tzinfo=None)


class TeamRow(Base):
    """A team: the unit of quota and fair share."""

    __tablename__ = "teams"

    name: Mapped[str] = mapped_column(sa.String(63), primary_key=True)
    display_name: Mapped[str] = mapped_column(sa.String(255), default="")
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow)


class QuotaRow(Base):
    """A team's GPU quota for one GPU type."""

    __tablename__ = "quotas"

    team: Mapped[str] = mapped_column(sa.ForeignKey("teams.name", ondelete="CASCADE"), primary_key=True)
    gpu_type: Mapped[str] = mapped_column(sa.String(63), primary_key=True)
    guaranteed_gpus: Mapped[int] = mapped_column(sa.Integer, default=0)
    borrow_limit: Mapped[int] = mapped_column(sa.Integer, default=0)
    weight: Mapped[float] = mapped_column(sa.Float, default=1.0)


class JobRow(Base):
    """A job record; ``spec`` is the serialised ``forge.scheduler.v1.JobSpec`` as submitted."""

    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(sa.String(40), primary_key=True)
    request_id: Mapped[str | None] = mapped_column(sa.String(128), unique=True, nullable=True)
    name: Mapped[str] = mapped_column(sa.String(255))
    team: Mapped[str] = mapped_column(sa.ForeignKey("teams.name"), index=True)
    priority_class: Mapped[str] = mapped_column(sa.String(32))
    gpu_type: Mapped[str] = mapped_column(sa.String(63), default="")
    gpus_per_replica: Mapped[int] = mapped_column(sa.Integer, default=0)
    replicas: Mapped[int] = mapped_column(sa.Integer, default=1)
    spec: Mapped[bytes] = mapped_column(sa.LargeBinary)
    state: Mapped[int] = mapped_column(sa.Integer, index=True)
    message: Mapped[str] = mapped_column(sa.Text, default="")
    assigned_nodes: Mapped[list[str]] = mapped_column(sa.JSON, default=list)
    preemption_count: Mapped[int] = mapped_column(sa.Integer, default=0)
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow, index=True)
    started_at: Mapped[dt.datetime | None] = mapped_column(sa.DateTime, nullable=True)
    finished_at: Mapped[dt.datetime | None] = mapped_column(sa.DateTime, nullable=True)


class NodeRow(Base):
    """A node registered by its trainer agent."""

    __tablename__ = "nodes"

    node_id: Mapped[str] = mapped_column(sa.String(40), primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(255), unique=True)
    gpus: Mapped[list[dict[str, Any]]] = mapped_column(sa.JSON, default=list)
    node_group: Mapped[str] = mapped_column(sa.String(255), default="")
    rack: Mapped[str] = mapped_column(sa.String(255), default="")
    nvlink_domain: Mapped[str] = mapped_column(sa.String(255), default="")
    labels: Mapped[dict[str, str]] = mapped_column(sa.JSON, default=dict)
    state: Mapped[int] = mapped_column(sa.Integer)
    last_heartbeat_at: Mapped[dt.datetime | None] = mapped_column(sa.DateTime, nullable=True)
    running_job_ids: Mapped[list[str]] = mapped_column(sa.JSON, default=list)
