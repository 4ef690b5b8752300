"""RLHF rounds as the orchestrator's RLHF workflow reports them, for the admin page and the API.

The workflow owns the loop; this table is its visible record: one row per (workflow, round),
created on the round's first report and updated at each step (status, step, snapshot, pinned
reward model, the policy checkpoint, figures, and why a round was stopped or refused). A round
that has ended (``completed``, ``stopped``, ``rejected``) is not reopened. Every report also stages
an ``RlhfRoundUpdated`` event with the round as stored, in the same transaction (outbox).
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from forge.common.v1 import common_pb2
from forge.events.v1 import events_pb2

from forge_kit import errors
from forge_kit.db import Database
from forge_kit.events import stage_event
from forge_kit.modelref import ModelRef
from forge_preference_feedback.store import RlhfRoundRow, utcnow

ROUND_STATUSES = ("running", "completed", "stopped", "rejected", "stalled")
ENDED = frozenset({"completed", "stopped", "rejected"})
_WORKFLOW = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


@dataclass(frozen=True)
class RoundReport:
    """What the workflow reports about a round; empty strings leave the stored value as it is."""

    workflow_id: str
    round: int
    status: str
    step: str = ""
    snapshot_id: str = ""
    reward_model: str = ""
    policy_uri: str = ""
    reason: str = ""
    metrics: Mapping[str, float] = field(default_factory=dict)

    def check(self) -> None:
        if not _WORKFLOW.match(self.workflow_id):
            raise errors.ValidationError(
                "round.workflow_id", "must be 1-128 letters, digits, '.', '_', ':' or '-'"
            )
        if self.round < 1:
            raise errors.ValidationError("round.round", f"must be at least 1, got {self.round}")
        if self.status not in ROUND_STATUSES:
            raise errors.ValidationError("round.status", f"must be one of {', '.join(ROUND_STATUSES)}")
        if len(self.step) > 255:
            raise errors.ValidationError("round.step", "must be at most 255 characters")
        for key, value in self.metrics.items():
            if not key:
                raise errors.ValidationError("round.metrics", "names must not be empty")
            if not math.isfinite(value):
                raise errors.ValidationError(f"round.metrics.{key}", "must be finite")


class RlhfRounds:
    """The ``feedback_rlhf_rounds`` table; every method is one transaction."""

    def __init__(
        self,
        db: Database,
        *,
        clock: Callable[[], dt.datetime] = utcnow,
        producer: str = "preference_feedback",
    ) -> None:
        self._db = db
        self._clock = clock
        self._producer = producer

    async def record(self, report: RoundReport) -> RlhfRoundRow:
        """Create or update the round; metrics are merged. An ended round refuses a change of
        status (``FAILED_PRECONDITION``); reporting the same end again is accepted."""
        report.check()
        now = self._clock()
        async with self._db.session() as session:
            row = await session.get(RlhfRoundRow, (report.workflow_id, report.round))
            if row is None:
                row = RlhfRoundRow(
                    workflow_id=report.workflow_id,
                    round=report.round,
                    status=report.status,
                    step="",
                    snapshot_id="",
                    reward_model="",
                    policy_uri="",
                    reason="",
                    metrics={},
                    started_at=now,
                    updated_at=now,
                )
                session.add(row)
            elif row.status in ENDED and report.status != row.status:
                raise errors.ConflictError(
                    f"round {report.round} of {report.workflow_id} already ended {row.status}"
                )
            row.status = report.status
            for name in ("step", "snapshot_id", "reward_model", "policy_uri", "reason"):
                value = getattr(report, name)
                if value:
                    setattr(row, name, value)
            row.metrics = {**row.metrics, **{k: float(v) for k, v in report.metrics.items()}}
            row.updated_at = now
            await stage_event(
                session, round_event(row), producer=self._producer, key=f"{row.workflow_id}/{row.round}"
            )
        return row

    async def list(self, workflow_id: str, page_size: int, offset: int) -> tuple[list[RlhfRoundRow], int]:
        """Rounds (of ``workflow_id``, or all), most recently updated first, and how many there are."""
        query = sa.select(RlhfRoundRow)
        if workflow_id:
            query = query.where(RlhfRoundRow.workflow_id == workflow_id)
        async with self._db.session() as session:
            total = int(await session.scalar(sa.select(sa.func.count()).select_from(query.subquery())) or 0)
            rows = (
                await session.scalars(
                    query.order_by(
                        RlhfRoundRow.updated_at.desc(), RlhfRoundRow.workflow_id, RlhfRoundRow.round.desc()
                    )
                    .offset(offset)
                    .limit(page_size)
                )
            ).all()
        return list(rows), total


def round_fields(row: RlhfRoundRow) -> dict[str, Any]:
    """The round's fields as ``RlhfRound`` (API) and ``RlhfRoundUpdated`` (event) both name them."""
    reward_model = ModelRef.parse_optional(row.reward_model)
    return {
        "workflow_id": row.workflow_id,
        "round": row.round,
        "status": row.status,
        "step": row.step,
        "snapshot_id": row.snapshot_id,
        "reward_model": (
            common_pb2.ModelRef(name=reward_model.name, version=reward_model.version)
            if reward_model
            else None
        ),
        "policy_uri": row.policy_uri,
        "reason": row.reason,
        "metrics": dict(row.metrics),
    }


def round_event(row: RlhfRoundRow) -> events_pb2.RlhfRoundUpdated:
    """The round as stored, as the event every report publishes."""
    return events_pb2.RlhfRoundUpdated(**round_fields(row))
