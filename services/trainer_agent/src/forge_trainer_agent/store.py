"""Trainer agent persistence: one row per attempt of a job replica on this node.

``version`` counts the row's state changes and ``reported_version`` is the newest of them written
to the scheduler, so a state reached while the session was down is sent after reconnecting, even
across an agent restart.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import Any

import sqlalchemy as sa
from forge.common.v1 import common_pb2
from sqlalchemy.orm import Mapped, mapped_column

from forge_kit.db import Base, Database, utcnow

JobState = common_pb2.JobState
ACTIVE_STATES = (JobState.JOB_STATE_SCHEDULED, JobState.JOB_STATE_RUNNING)


class RunRow(Base):
    """One attempt of one job replica on this node."""

    __tablename__ = "runs"

    job_id: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    attempt: Mapped[int] = mapped_column(sa.Integer, primary_key=True)
    run_id: Mapped[str] = mapped_column(sa.String(40), index=True)
    state: Mapped[int] = mapped_column(sa.Integer, index=True)
    version: Mapped[int] = mapped_column(sa.Integer, default=0)
    reported_version: Mapped[int] = mapped_column(sa.Integer, default=0)
    pid: Mapped[int | None] = mapped_column(sa.Integer, nullable=True)
    command: Mapped[list[str]] = mapped_column(sa.JSON, default=list)
    gpu_indices: Mapped[list[int]] = mapped_column(sa.JSON, default=list)
    node_rank: Mapped[int] = mapped_column(sa.Integer, default=0)
    num_nodes: Mapped[int] = mapped_column(sa.Integer, default=1)
    log_path: Mapped[str] = mapped_column(sa.Text, default="")
    message: Mapped[str] = mapped_column(sa.Text, default="")
    exit_code: Mapped[int | None] = mapped_column(sa.Integer, nullable=True)
    step: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    last_checkpoint_uri: Mapped[str] = mapped_column(sa.Text, default="")
    last_checkpoint_step: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    last_checkpoint_at: Mapped[dt.datetime | None] = mapped_column(sa.DateTime, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow, index=True)
    started_at: Mapped[dt.datetime | None] = mapped_column(sa.DateTime, nullable=True)
    finished_at: Mapped[dt.datetime | None] = mapped_column(sa.DateTime, nullable=True)


class RunStore:
    """Queries over :class:`RunRow`; each method is one transaction."""

    def __init__(self, db: Database) -> None:
        self._db = db

    async def get(self, job_id: str, attempt: int) -> RunRow | None:
        async with self._db.session() as session:
            return await session.get(RunRow, (job_id, attempt))

    async def run_id_for(self, job_id: str) -> str | None:
        """The run id earlier attempts of ``job_id`` used, so it stays stable across preemptions."""
        async with self._db.session() as session:
            return await session.scalar(sa.select(RunRow.run_id).where(RunRow.job_id == job_id).limit(1))

    async def add(self, row: RunRow) -> RunRow:
        async with self._db.session() as session:
            session.add(row)
        return row

    async def update(self, job_id: str, attempt: int, **fields: Any) -> RunRow:
        """Apply ``fields``; a change of ``state`` bumps ``version`` so it gets reported."""
        async with self._db.session() as session:
            row = await session.get(RunRow, (job_id, attempt))
            if row is None:
                raise KeyError(f"run {job_id}#{attempt} is not stored")
            if "state" in fields and fields["state"] != row.state:
                row.version += 1
            for name, value in fields.items():
                setattr(row, name, value)
        return row

    async def mark_reported(self, job_id: str, attempt: int, version: int) -> None:
        async with self._db.session() as session:
            await session.execute(
                sa.update(RunRow)
                .where(RunRow.job_id == job_id, RunRow.attempt == attempt, RunRow.reported_version < version)
                .values(reported_version=version)
            )

    async def active(self) -> list[RunRow]:
        """Attempts that were started and have not finished, oldest first."""
        async with self._db.session() as session:
            query = sa.select(RunRow).where(RunRow.state.in_(ACTIVE_STATES)).order_by(RunRow.created_at)
            return list((await session.scalars(query)).all())

    async def unreported(self) -> list[RunRow]:
        """Attempts whose newest state has not been written to the scheduler, oldest first."""
        async with self._db.session() as session:
            query = (
                sa.select(RunRow).where(RunRow.version > RunRow.reported_version).order_by(RunRow.created_at)
            )
            return list((await session.scalars(query)).all())

    async def list_latest(
        self, job_ids: Iterable[str], page_size: int, offset: int
    ) -> tuple[list[RunRow], int]:
        """The newest attempt of each job (filtered to ``job_ids`` when given), newest first."""
        wanted = list(job_ids)
        latest = sa.select(RunRow.job_id, sa.func.max(RunRow.attempt).label("attempt")).group_by(
            RunRow.job_id
        )
        if wanted:
            latest = latest.where(RunRow.job_id.in_(wanted))
        newest = latest.subquery()
        query = sa.select(RunRow).join(
            newest, sa.and_(RunRow.job_id == newest.c.job_id, RunRow.attempt == newest.c.attempt)
        )
        async with self._db.session() as session:
            total = int(await session.scalar(sa.select(sa.func.count()).select_from(newest)) or 0)
            ordered = (
                query.order_by(RunRow.created_at.desc(), RunRow.job_id.desc()).offset(offset).limit(page_size)
            )
            rows = (await session.scalars(ordered)).all()
        return list(rows), total
