"""A guarded canary's decisions in the registry: promote, rollback, extend, pause, resume.

The orchestrator's canary analysis (or an operator through ``forge eval rollout``) records each
decision here with its evidence, so the registry's history says why a model left canary:

* ``promote``: canary → production through the release gate (:meth:`ModelRegistry.promote_model`);
  production's previous holder is archived and stays registered (and loaded where it is served),
  so ``forge eval rollback production`` restores it at once;
* ``rollback``: the canary is archived and ``ModelPromoted`` (stage ``canary``, ``is_rollback``,
  traffic 0) tells every gateway to stop its split;
* ``extend``, ``pause``, ``resume``: an audit row on the canary (the analysis reads pause/resume).
"""

from __future__ import annotations

import json

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession

from forge_eval.registry import (
    ModelRegistry,
    Promotion,
    _event_view,
    _model_view,
    validate_model_name,
    validate_version,
)
from forge_eval.store.registry import ARCHIVED, CANARY, PRODUCTION, StageEventRow, find_model, holders
from forge_kit import errors
from forge_kit.validate import check_text

DECISIONS = ("promote", "rollback", "extend", "pause", "resume")
MAX_EVIDENCE_BYTES = 64 * 1024
MAX_REASON_CHARS = 2000


def check_evidence(evidence: str) -> str:
    """Empty, or a JSON object of at most 64 KiB (stored as sent)."""
    if not evidence:
        return ""
    if len(evidence.encode()) > MAX_EVIDENCE_BYTES:
        raise errors.ValidationError("evidence", f"must be at most {MAX_EVIDENCE_BYTES} bytes")
    try:
        parsed = json.loads(evidence)
    except ValueError as exc:
        raise errors.ValidationError("evidence", f"must be JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise errors.ValidationError("evidence", "must be a JSON object")
    return evidence


async def decide_rollout(
    registry: ModelRegistry,
    name: str,
    version: str,
    decision: str,
    reason: str,
    evidence: str = "",
    *,
    actor: str = "",
    admin: bool = True,
) -> Promotion:
    """Record ``decision`` on the canary ``name:version`` (module docstring); a retried call whose
    answer was lost (the model already promoted, or already rolled back) returns the first record."""
    validate_model_name("ref.name", name)
    validate_version("ref.version", version)
    if decision not in DECISIONS:
        raise errors.ValidationError("decision", f"must be one of {', '.join(DECISIONS)}, got {decision!r}")
    if not reason.strip():
        raise errors.ValidationError("reason", "is required (a rollout decision is audited)")
    check_text("reason", reason, MAX_REASON_CHARS)
    evidence = check_evidence(evidence)
    async with registry._db.session() as session:
        model = await find_model(session, name, version)
        if model is None:
            raise errors.NotFoundError(f"model {name}:{version} is not registered")
        done = await _already(session, model.id, decision, model.stage)
        if done is not None:
            return Promotion(await _model_view(session, model), None, await _event_view(session, done))
        if model.stage != CANARY:
            raise errors.ConflictError(
                f"model {name}:{version} is {model.stage}, not canary; no rollout to decide"
            )
    if decision == "promote":
        return await registry.promote_model(
            name,
            version,
            PRODUCTION,
            traffic_percent=100,
            reason=f"canary promoted: {reason}",
            actor=actor,
            admin=admin,
            evidence=evidence,
        )
    async with registry._db.session() as session:
        model = await find_model(session, name, version)
        assert model is not None
        if model.stage != CANARY:  # moved since the check above
            raise errors.ConflictError(
                f"model {name}:{version} is {model.stage}, not canary; no rollout to decide"
            )
        holder = (await holders(session)).get(CANARY)
        traffic = holder.traffic_percent if holder is not None and holder.model_id == model.id else 0
        if decision == "rollback":
            for row in await session.scalars(
                sa.select(StageEventRow).where(
                    StageEventRow.model_id == model.id,
                    StageEventRow.stage == CANARY,
                    StageEventRow.action == "promote",
                )
            ):
                row.rolled_back = True
            event = registry._event(
                "rollback",
                model,
                from_stage=CANARY,
                to_stage=ARCHIVED,
                actor=actor,
                reason=f"canary rolled back: {reason}",
                evidence=evidence,
            )
            model.stage = ARCHIVED
            session.add(event)
            await session.flush()
            await registry._stage_promotion(
                session, model, CANARY, None, 0, f"canary rolled back: {reason}", is_rollback=True
            )
        else:
            event = registry._event(
                decision,
                model,
                from_stage=CANARY,
                to_stage=CANARY,
                actor=actor,
                reason=reason,
                traffic_percent=traffic,
                evidence=evidence,
            )
            session.add(event)
            await session.flush()
        view = await _model_view(session, model)
        record = await _event_view(session, event)
    registry._on_commit()
    return Promotion(view, None, record)


async def _already(session: AsyncSession, model_id: int, decision: str, stage: str) -> StageEventRow | None:
    """The record of a promote or rollback already done to this model (a retry), else None."""
    wanted = {"promote": (PRODUCTION, "promote"), "rollback": (ARCHIVED, "rollback")}.get(decision)
    if wanted is None or stage != wanted[0]:
        return None
    return await session.scalar(
        sa.select(StageEventRow)
        .where(
            StageEventRow.model_id == model_id,
            StageEventRow.stage == wanted[0],
            StageEventRow.action == wanted[1],
            StageEventRow.from_stage == CANARY,
        )
        .order_by(StageEventRow.id.desc())
        .limit(1)
    )
