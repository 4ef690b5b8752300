"""Scheduler persistence: teams, quotas, jobs and nodes (SQLAlchemy 2, one database)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Mapped, mapped_column

from forge_kit.db import Base, utcnow
from forge_scheduler.jobspec import JobSpec


class TeamRow(Base):
    """A team: the unit of quota and fair share."""

    __tablename__ = "teams"

    name: Mapped[str] = mapped_column(sa.String(63), primary_key=True)
    display_name: Mapped[str] = mapped_column(sa.String(255), default="")
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow)
    cohort: Mapped[str] = mapped_column(sa.String(63), default="default")


class QuotaRow(Base):
    """A team's GPU quota for one GPU type."""

    __tablename__ = "quotas"

    team: Mapped[str] = mapped_column(sa.ForeignKey("teams.name", ondelete="CASCADE"), primary_key=True)
    gpu_type: Mapped[str] = mapped_column(sa.String(63), primary_key=True)
    guaranteed_gpus: Mapped[int] = mapped_column(sa.Integer, default=0)
    borrow_limit: Mapped[int] = mapped_column(sa.Integer, default=0)
    weight: Mapped[float] = mapped_column(sa.Float, default=1.0)


class JobRow(Base):
    """A job record; ``spec`` is what was submitted, the domain's :class:`JobSpec` as JSON
    (:attr:`job_spec` reads it back)."""

    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(sa.String(40), primary_key=True)
    request_id: Mapped[str | None] = mapped_column(sa.String(128), unique=True, nullable=True)
    name: Mapped[str] = mapped_column(sa.String(255))
    team: Mapped[str] = mapped_column(sa.ForeignKey("teams.name"), index=True)
    priority_class: Mapped[str] = mapped_column(sa.String(32))
    gpu_type: Mapped[str] = mapped_column(sa.String(63), default="")
    gpus_per_replica: Mapped[int] = mapped_column(sa.Integer, default=0)
    replicas: Mapped[int] = mapped_column(sa.Integer, default=1)
    spec: Mapped[dict[str, Any]] = mapped_column(sa.JSON)
    state: Mapped[int] = mapped_column(sa.Integer, index=True)
    message: Mapped[str] = mapped_column(sa.Text, default="")
    assigned_nodes: Mapped[list[str]] = mapped_column(sa.JSON, default=list)
    preemption_count: Mapped[int] = mapped_column(sa.Integer, default=0)
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow, index=True)
    started_at: Mapped[dt.datetime | None] = mapped_column(sa.DateTime, nullable=True)
    finished_at: Mapped[dt.datetime | None] = mapped_column(sa.DateTime, nullable=True)
    placement: Mapped[str] = mapped_column(sa.String(16), default="any")
    """``any``, ``same_node`` or ``same_group`` (the policy's Placement values)."""
    min_runtime_s: Mapped[float] = mapped_column(sa.Float, default=0.0)
    checkpointable: Mapped[bool] = mapped_column(sa.Boolean, default=False)
    checkpoint_interval_s: Mapped[float] = mapped_column(sa.Float, default=0.0)
    attempt: Mapped[int] = mapped_column(sa.Integer, default=0)
    """Starts so far; StartJob carries it so an agent can tell a new attempt from a repeat."""
    queued_at: Mapped[dt.datetime | None] = mapped_column(sa.DateTime, nullable=True)
    """When it last entered the queue (submit, preemption or node loss)."""
    slots: Mapped[list[list[Any]] | None] = mapped_column(sa.JSON, nullable=True)
    """While placed: one ``[node name, [gpu indices]]`` per replica, in rank order."""
    replica_states: Mapped[dict[str, int] | None] = mapped_column(sa.JSON, nullable=True)
    """While placed: the last state each replica's agent reported, by rank (as a string)."""
    draining: Mapped[list[list[Any]] | None] = mapped_column(sa.JSON, nullable=True)
    """Replicas of an earlier placement still stopping (``[node, [gpu indices]]``): their GPUs stay
    taken until the agent reports the replica ended or the node is lost."""
    endpoints: Mapped[dict[str, str] | None] = mapped_column(sa.JSON, nullable=True)
    """While placed, serving jobs: the URL each running replica serves on, by node (its agent's
    RUNNING report)."""
    borrowed: Mapped[bool] = mapped_column(sa.Boolean, default=False)
    submitted_by_admin: Mapped[bool] = mapped_column(sa.Boolean, default=False, server_default=sa.false())
    """An admin principal (not a team token) submitted it; StartJob carries it to the agent."""
    attained_gpu_s: Mapped[float] = mapped_column(sa.Float, default=0.0)
    """GPU-seconds used by earlier attempts (least-attained-service ordering)."""
    last_checkpoint_at: Mapped[dt.datetime | None] = mapped_column(sa.DateTime, nullable=True)
    preempt_by: Mapped[dt.datetime | None] = mapped_column(sa.DateTime, nullable=True)
    """Set when a preemption was ordered: the end of the victim's checkpoint grace period."""
    pending_reason: Mapped[str] = mapped_column(sa.Text, default="")
    estimated_start: Mapped[dt.datetime | None] = mapped_column(sa.DateTime, nullable=True)
    version: Mapped[int] = mapped_column(sa.Integer, default=0, server_default="0")
    """Bumped by every write; an UPDATE of a row another unit changed since it was read matches
    nothing and fails (``StaleDataError``), and that unit runs again on the fresh row. Two
    replicas' reports processed side by side used to both read the job, both fail it, and the
    later commit put back a replica the earlier had freed: its GPU stayed draining for good."""

    __mapper_args__ = {"version_id_col": version}

    @property
    def job_spec(self) -> JobSpec:
        """What was submitted, typed."""
        return JobSpec.from_json(self.spec)


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
    job_isolation: Mapped[dict[str, Any] | None] = mapped_column(sa.JSON, nullable=True)
    """``forge.scheduler.v1.JobIsolation`` as its agent registered it (JSON field names)."""


class TeamUsageRow(Base):
    """A team's decayed historical GPU usage (the fair-share input), kept across restarts."""

    __tablename__ = "team_usage"

    team: Mapped[str] = mapped_column(sa.String(63), primary_key=True)
    decayed_gpu_s: Mapped[float] = mapped_column(sa.Float, default=0.0)
    updated_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow)


class TeamTokenRow(Base):
    """A bearer token that acts for one team; only its SHA-256 is stored."""

    __tablename__ = "team_tokens"

    token_hash: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    team: Mapped[str] = mapped_column(sa.ForeignKey("teams.name", ondelete="CASCADE"), index=True)
    description: Mapped[str] = mapped_column(sa.String(255), default="")
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow)
