"""The model registry: model versions with their lineage, the stage lifecycle, promotion and
rollback, and the audit trail.

A model version's lifecycle is ``candidate`` (registered) → ``canary`` → ``production`` →
``archived``; every change is an append-only audit event (who, when, why, and for a promotion
forced past a failing gate, that gate's report). Changes of a serving stage (canary, production)
are written with their ``ModelPromoted`` event in one transaction (the outbox). Canary and
production need a run that passed the release gate (:mod:`forge_eval.gate`).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import sqlalchemy as sa
import structlog
from forge.common.v1 import common_pb2
from forge.events.v1 import events_pb2
from sqlalchemy.ext.asyncio import AsyncSession

from forge_eval.gate import gate_check
from forge_eval.store.registry import (
    ARCHIVED,
    CANARY,
    CANDIDATE,
    PRODUCTION,
    SERVING,
    STAGES,
    ModelRow,
    StageEventRow,
    find_model,
    holders,
)
from forge_eval.store.runs import RunRow
from forge_kit import errors
from forge_kit.db import Database, utcnow
from forge_kit.events import stage_event
from forge_kit.modelref import check_name, check_version, label
from forge_kit.validate import MAX_URI_CHARS, check_labels, check_text

log = structlog.get_logger(__name__)

#: Where a promotion may take a model from each stage (a rollback aside). Canary → canary
#: re-promotes with a new traffic share.
TRANSITIONS: dict[str, frozenset[str]] = {
    CANDIDATE: frozenset({CANARY, PRODUCTION, ARCHIVED}),
    CANARY: frozenset({CANARY, PRODUCTION, ARCHIVED}),
    PRODUCTION: frozenset(),
    ARCHIVED: frozenset(),
}


@dataclass(frozen=True)
class Lineage:
    """Where a checkpoint came from; ``parent`` is a registered (name, version)."""

    training_run_id: str = ""
    recipe_hash: str = ""
    data_hash: str = ""
    parent: tuple[str, str] | None = None


@dataclass(frozen=True)
class ModelView:
    """A registered model: its lifecycle stage, traffic share when serving, runs and parent."""

    row: ModelRow
    stage: str
    traffic_percent: int
    eval_run_ids: tuple[str, ...]
    parent: tuple[str, str] | None = None


@dataclass(frozen=True)
class StageEventView:
    """One audit event with the models it names resolved."""

    row: StageEventRow
    model: tuple[str, str]
    previous: tuple[str, str] | None


@dataclass(frozen=True)
class Promotion:
    """A promotion's or rollback's outcome: the model, the one it displaced, the audit event."""

    model: ModelView
    previous: ModelRow | None
    event: StageEventView


def validate_model_name(field: str, value: str) -> None:
    """A registry name is a :class:`~forge_kit.modelref.ModelRef`'s name."""
    if not value:
        raise errors.ValidationError(field, "must not be empty")
    try:
        check_name(value)
    except ValueError as exc:
        raise errors.ValidationError(field, str(exc)) from None


def validate_version(field: str, value: str) -> None:
    """A registry version is a :class:`~forge_kit.modelref.ModelRef`'s version, never empty."""
    if not value:
        raise errors.ValidationError(field, "must not be empty")
    try:
        check_version(value)
    except ValueError as exc:
        raise errors.ValidationError(field, str(exc)) from None


def validate_stage(field: str, value: str) -> None:
    if not value:
        raise errors.ValidationError(field, "must not be empty")
    if value not in STAGES:
        raise errors.ValidationError(field, f"must be one of {', '.join(STAGES)}, got {value!r}")


class ModelRegistry:
    """Owns the registry's tables; every public method is one transaction."""

    def __init__(
        self,
        db: Database,
        *,
        producer: str = "eval",
        clock: Callable[[], dt.datetime] = utcnow,
        on_commit: Callable[[], None] = lambda: None,
    ) -> None:
        self._db = db
        self._producer = producer
        self._clock = clock
        self._on_commit = on_commit

    async def register_model(
        self,
        name: str,
        version: str,
        uri: str,
        labels: Mapping[str, str],
        lineage: Lineage | None = None,
        *,
        actor: str = "",
    ) -> ModelView:
        """Add a model version as a ``candidate``; an empty version takes the next integer of the
        family. The parent named in ``lineage`` must be registered."""
        validate_model_name("ref.name", name)
        if version:
            validate_version("ref.version", version)
        if not uri.strip():
            raise errors.ValidationError("uri", "must not be empty")
        check_text("uri", uri, MAX_URI_CHARS)
        check_labels("labels", labels)
        lineage = lineage or Lineage()
        for field in ("training_run_id", "recipe_hash", "data_hash"):
            if len(getattr(lineage, field)) > 128:
                raise errors.ValidationError(f"lineage.{field}", "must be at most 128 characters")
        async with self._db.session() as session:
            parent_id: int | None = None
            if lineage.parent is not None:
                parent = await find_model(session, *lineage.parent)
                if parent is None:
                    raise errors.ValidationError(
                        "lineage.parent", f"model {':'.join(lineage.parent)} is not registered"
                    )
                parent_id = parent.id
            if not version:
                existing = (
                    await session.scalars(sa.select(ModelRow.version).where(ModelRow.name == name))
                ).all()
                version = str(max((int(v) for v in existing if v.isdigit()), default=0) + 1)
            elif await find_model(session, name, version) is not None:
                raise errors.AlreadyExistsError(f"model {name}:{version} is already registered")
            row = ModelRow(
                name=name,
                version=version,
                uri=uri,
                labels=dict(labels),
                created_at=self._clock(),
                stage=CANDIDATE,
                training_run_id=lineage.training_run_id,
                recipe_hash=lineage.recipe_hash,
                data_hash=lineage.data_hash,
                parent_model_id=parent_id,
            )
            session.add(row)
            await session.flush()
            session.add(
                self._event(
                    "register", row, from_stage="", to_stage=CANDIDATE, actor=actor, reason="registered"
                )
            )
            return await _model_view(session, row)

    async def list_models(
        self, name: str, stage: str, page_size: int, offset: int
    ) -> tuple[list[ModelView], int]:
        query = sa.select(ModelRow)
        if name:
            query = query.where(ModelRow.name == name)
        if stage:
            validate_stage("stage", stage)
            query = query.where(ModelRow.stage == stage)
        async with self._db.session() as session:
            total = int(await session.scalar(sa.select(sa.func.count()).select_from(query.subquery())) or 0)
            rows = (
                await session.scalars(
                    query.order_by(ModelRow.created_at.desc(), ModelRow.id.desc())
                    .offset(offset)
                    .limit(page_size)
                )
            ).all()
            return [await _model_view(session, r) for r in rows], total

    async def promote_model(
        self,
        name: str,
        version: str,
        stage: str,
        *,
        traffic_percent: int,
        reason: str,
        force: bool = False,
        actor: str = "",
        admin: bool = True,
        evidence: str = "",
    ) -> Promotion:
        """Move ``name:version`` to ``stage`` along its lifecycle.

        1. Check the transition (canary from candidate; production from candidate or canary;
           archived from candidate or canary);
        2. canary and production need one of its finished runs to have passed the release gate;
           without one the promotion is refused unless ``force`` is set by an ``admin`` with a
           reason, and then the failing gate's report is kept with the event;
        3. the stage's previous holder is archived (production) or archived (a displaced canary);
        4. write the audit event and, for canary and production, ``ModelPromoted`` (outbox).
        """
        validate_model_name("ref.name", name)
        if not version:
            raise errors.ValidationError("ref.version", "is required to promote")
        validate_version("ref.version", version)
        validate_stage("stage", stage)
        if stage == CANDIDATE:
            raise errors.ValidationError(
                "stage", "a model is a candidate when registered; promote to canary, production or archived"
            )
        if traffic_percent > 100:
            raise errors.ValidationError("traffic_percent", "must be between 0 and 100")
        if force:
            if not admin:
                raise errors.PermissionDeniedError(
                    f"forcing a promotion past the release gate needs an admin token; {actor or 'the caller'} is not an admin"
                )
            if stage not in SERVING:
                raise errors.ValidationError(
                    "force", "only canary and production have a release gate to force"
                )
            if not reason.strip():
                raise errors.ValidationError("reason", "is required to force a promotion (it is audited)")
        traffic = traffic_percent or 100
        async with self._db.session() as session:
            model = await find_model(session, name, version)
            if model is None:
                raise errors.NotFoundError(f"model {name}:{version} is not registered")
            holder = (await holders(session)).get(stage) if stage in SERVING else None
            if holder is not None and holder.model_id == model.id and holder.traffic_percent == traffic:
                # Already done (a retried call whose answer was lost): report it, change nothing.
                return Promotion(await _model_view(session, model), None, await _event_view(session, holder))
            allowed = TRANSITIONS[model.stage]
            if stage not in allowed:
                raise errors.ConflictError(
                    f"model {name}:{version} is {model.stage}; it cannot move to {stage} "
                    f"(from {model.stage}: {', '.join(sorted(allowed)) or 'only a rollback'})"
                )
            gate_run_id, gate_report, forced = "", "", False
            if stage in SERVING:
                gate_run_id, report = await gate_check(session, model)
                if not gate_run_id:
                    if not force:
                        raise errors.ConflictError(
                            f"release gate: {report['summary']}; an admin may force it (force with a reason)"
                        )
                    forced = True
                    gate_report = json.dumps(report, sort_keys=True)
            previous = (
                await session.get(ModelRow, holder.model_id)
                if holder is not None and holder.model_id != model.id
                else None
            )
            if forced:
                why = reason
            else:
                why = reason or (f"gate passed: eval run {gate_run_id}" if gate_run_id else stage)
            now_actor = actor or "anonymous"
            if previous is not None:
                session.add(
                    self._event(
                        "archive",
                        previous,
                        from_stage=previous.stage,
                        to_stage=ARCHIVED,
                        actor=now_actor,
                        reason=f"replaced in {stage} by {name}:{version}",
                    )
                )
                previous.stage = ARCHIVED
            event = self._event(
                "archive" if stage == ARCHIVED else "promote",
                model,
                from_stage=model.stage,
                to_stage=stage,
                actor=now_actor,
                reason=why,
                previous=previous,
                traffic_percent=traffic if stage in SERVING else 0,
                gate_run_id=gate_run_id,
                forced=forced,
                gate_report=gate_report,
                evidence=evidence,
            )
            session.add(event)
            model.stage = stage
            await session.flush()
            if stage in SERVING:
                await self._stage_promotion(session, model, stage, previous, traffic, why, is_rollback=False)
            view = await _model_view(session, model)
            record = await _event_view(session, event)
        if forced:
            log.warning(
                "eval.promotion_forced", model=label(name, version), stage=stage, actor=now_actor, reason=why
            )
        self._on_commit()
        return Promotion(view, previous, record)

    async def rollback_model(self, stage: str, reason: str, *, actor: str = "") -> Promotion:
        """Give ``stage`` back to the model that held it before its current holder, if that model
        was archived by being replaced; the current holder is archived."""
        validate_stage("stage", stage)
        if stage not in SERVING:
            raise errors.ValidationError("stage", "only canary and production can be rolled back")
        async with self._db.session() as session:
            holder = (await holders(session)).get(stage)
            if holder is None:
                raise errors.ConflictError(f"stage {stage!r} has no model to roll back")
            removed = await session.get(ModelRow, holder.model_id)
            assert removed is not None
            stack = list(
                (
                    await session.scalars(
                        sa.select(StageEventRow)
                        .where(
                            StageEventRow.stage == stage,
                            StageEventRow.action == "promote",
                            StageEventRow.rolled_back.is_(False),
                        )
                        .order_by(StageEventRow.id)
                    )
                ).all()
            )
            for row in stack:
                if row.model_id == removed.id:
                    row.rolled_back = True
            stack = [row for row in stack if row.model_id != removed.id]
            if not stack:
                raise errors.ConflictError(f"stage {stage!r} has no earlier model to roll back to")
            restored = stack[-1]
            model = await session.get(ModelRow, restored.model_id)
            assert model is not None
            if model.stage != ARCHIVED:
                raise errors.ConflictError(
                    f"the previous holder of {stage!r}, {model.name}:{model.version}, is now {model.stage}; "
                    "archive the current holder or promote another model instead"
                )
            now_actor = actor or "anonymous"
            why = reason or f"rolled back from {removed.name}:{removed.version}"
            session.add(
                self._event(
                    "archive",
                    removed,
                    from_stage=removed.stage,
                    to_stage=ARCHIVED,
                    actor=now_actor,
                    reason=f"rolled back: {why}",
                )
            )
            removed.stage = ARCHIVED
            event = self._event(
                "rollback",
                model,
                from_stage=model.stage,
                to_stage=stage,
                actor=now_actor,
                reason=why,
                previous=removed,
                traffic_percent=restored.traffic_percent,
            )
            session.add(event)
            model.stage = stage
            await session.flush()
            await self._stage_promotion(
                session, model, stage, removed, restored.traffic_percent, why, is_rollback=True
            )
            view = await _model_view(session, model)
            record = await _event_view(session, event)
        self._on_commit()
        return Promotion(view, removed, record)

    async def list_stage_events(
        self,
        model_name: str,
        model_version: str,
        stage: str,
        *,
        forced_only: bool,
        page_size: int,
        offset: int,
    ) -> tuple[list[StageEventView], int]:
        """The audit trail, newest first."""
        if model_version and not model_name:
            raise errors.ValidationError("model_version", "needs model_name")
        if stage:
            validate_stage("stage", stage)
        query = sa.select(StageEventRow)
        if model_name:
            models = sa.select(ModelRow.id).where(ModelRow.name == model_name)
            if model_version:
                models = models.where(ModelRow.version == model_version)
            query = query.where(StageEventRow.model_id.in_(models))
        if stage:
            query = query.where(StageEventRow.stage == stage)
        if forced_only:
            query = query.where(StageEventRow.forced.is_(True))
        async with self._db.session() as session:
            total = int(await session.scalar(sa.select(sa.func.count()).select_from(query.subquery())) or 0)
            rows = (
                await session.scalars(query.order_by(StageEventRow.id.desc()).offset(offset).limit(page_size))
            ).all()
            return [await _event_view(session, r) for r in rows], total

    def _event(
        self,
        action: str,
        model: ModelRow,
        *,
        from_stage: str,
        to_stage: str,
        actor: str,
        reason: str,
        previous: ModelRow | None = None,
        traffic_percent: int = 0,
        gate_run_id: str = "",
        forced: bool = False,
        gate_report: str = "",
        evidence: str = "",
    ) -> StageEventRow:
        return StageEventRow(
            stage=to_stage,
            from_stage=from_stage,
            action=action,
            model_id=model.id,
            previous_model_id=previous.id if previous else None,
            traffic_percent=traffic_percent,
            reason=reason,
            gate_run_id=gate_run_id,
            rolled_back=False,
            actor=actor or "anonymous",
            forced=forced,
            gate_report=gate_report,
            evidence=evidence,
            created_at=self._clock(),
        )

    async def _stage_promotion(
        self,
        session: AsyncSession,
        model: ModelRow,
        stage: str,
        previous: ModelRow | None,
        traffic: int,
        reason: str,
        *,
        is_rollback: bool,
    ) -> None:
        event = events_pb2.ModelPromoted(
            model=common_pb2.ModelRef(name=model.name, version=model.version),
            stage=stage,
            traffic_percent=traffic,
            reason=reason,
            is_rollback=is_rollback,
        )
        if previous is not None:
            event.previous.CopyFrom(common_pb2.ModelRef(name=previous.name, version=previous.version))
        await stage_event(session, event, producer=self._producer, key=stage)


async def _model_view(session: AsyncSession, model: ModelRow) -> ModelView:
    holder = (await holders(session)).get(model.stage)
    traffic = holder.traffic_percent if holder is not None and holder.model_id == model.id else 0
    run_ids = (
        await session.scalars(
            sa.select(RunRow.id)
            .where(RunRow.model_name == model.name, RunRow.model_version == model.version)
            .order_by(RunRow.created_at)
        )
    ).all()
    parent = await session.get(ModelRow, model.parent_model_id) if model.parent_model_id else None
    return ModelView(
        model,
        model.stage,
        traffic,
        tuple(run_ids),
        (parent.name, parent.version) if parent is not None else None,
    )


async def _event_view(session: AsyncSession, row: StageEventRow) -> StageEventView:
    model = await session.get(ModelRow, row.model_id)
    assert model is not None
    previous = await session.get(ModelRow, row.previous_model_id) if row.previous_model_id else None
    return StageEventView(
        row, (model.name, model.version), (previous.name, previous.version) if previous else None
    )
