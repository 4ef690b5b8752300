"""Model aliases and their weighted canaries: what a bare model name resolves to.

Aliases change through ``ModelPromoted`` events (:meth:`Aliases.apply_model_promoted`, the
consumer's handler), so every gateway replica converges on the registry's decision, and through the
admin API (canary weight, rollback).
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import sqlalchemy as sa
from forge.events.v1 import events_pb2
from google.protobuf.message import Message
from sqlalchemy.ext.asyncio import AsyncSession

from forge_inference_gateway.caching.read_through import ReadThrough
from forge_inference_gateway.store import ModelAliasRow
from forge_kit import errors
from forge_kit.db import Database, utcnow
from forge_kit.modelref import ModelRef

_ALIAS = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")
#: Stage whose model the public alias ``forge-chat`` serves.
PUBLIC_ALIASES = {"production": "forge-chat"}
#: A promotion to the key stage becomes a weighted canary of the value stage's aliases.
CANARY_OF = {"canary": "production"}


@dataclass(frozen=True)
class Alias:
    alias: str
    model_name: str
    model_version: str
    stage: str
    updated_at: str
    canary_name: str = ""
    canary_version: str = ""
    canary_weight: int = 0
    shadow_name: str = ""
    shadow_version: str = ""
    shadow_percent: int = 0
    previous_name: str = ""
    previous_version: str = ""

    @property
    def previous(self) -> ModelRef | None:
        """The stable model version the alias named before :attr:`model` (None: none, or the
        same): the router keeps sending it the alias's traffic while no replica serves the new
        one yet (:meth:`~forge_inference_gateway.replicas.pool.ReplicaPool.serving`)."""
        if not self.previous_name:
            return None
        previous = ModelRef(self.previous_name, self.previous_version)
        return None if previous == self.model else previous

    @property
    def shadow(self) -> ModelRef | None:
        return (
            ModelRef(self.shadow_name, self.shadow_version)
            if self.shadow_name and self.shadow_percent
            else None
        )

    @property
    def model(self) -> ModelRef:
        """The stable model version the alias names (the registry's identity of it)."""
        return ModelRef(self.model_name, self.model_version)

    @property
    def canary(self) -> ModelRef | None:
        return ModelRef(self.canary_name, self.canary_version) if self.canary_name else None

    @property
    def target(self) -> str:
        """The model id sent upstream: ``name``, or ``name:version`` when a version is pinned."""
        return str(self.model)

    @property
    def canary_target(self) -> str | None:
        return str(self.canary) if self.canary is not None else None


def _occurred_ns(event: events_pb2.ModelPromoted) -> int:
    """When the registry made the change (``meta.occurred_at``, ns); 0 when the event has none."""
    stamp = event.meta.occurred_at
    return stamp.seconds * 1_000_000_000 + stamp.nanos


def _alias(row: ModelAliasRow) -> Alias:
    return Alias(
        row.alias,
        row.model_name,
        row.model_version,
        row.stage,
        row.updated_at.isoformat() + "Z",
        row.canary_model_name or "",
        row.canary_model_version or "",
        row.canary_weight or 0,
        row.shadow_model_name or "",
        row.shadow_model_version or "",
        row.shadow_percent or 0,
        row.previous_model_name or "",
        row.previous_model_version or "",
    )


def _set_stable(row: ModelAliasRow, name: str, version: str) -> None:
    """Point ``row`` at ``name:version``, remembering the model it named before (when another)."""
    if row.model_name and (row.model_name, row.model_version or "") != (name, version):
        row.previous_model_name, row.previous_model_version = row.model_name, row.model_version or ""
    row.model_name, row.model_version = name, version


def canary_bucket(alias: str, tenant_id: str, sticky: str) -> int:
    """0-99, fixed for a (alias, tenant, user/session/request): the canary takes buckets below its weight."""
    digest = hashlib.sha256(f"{alias}\x00{tenant_id}\x00{sticky}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % 100


class Aliases:
    """The alias table (``model_aliases``), each alias read kept ``ttl_s``."""

    def __init__(
        self, db: Database, *, ttl_s: float = 1.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._db = db
        self._cached: ReadThrough[str, Alias | None] = ReadThrough(ttl_s, clock)

    async def apply_model_promoted(self, event: Message, session: AsyncSession) -> None:
        """Consumer handler of ``ModelPromoted``: the stage (and its public alias) now names the model.

        A promotion to ``canary`` also makes the model the canary of the ``production`` aliases with
        the event's ``traffic_percent`` (0, or a rollback, stops the split; a canary rollback with
        no ``previous`` — a guarded canary ended — also drops the ``canary`` alias). A promotion to
        ``production`` ends the split (weight 0): the canary was measured against the stable it
        replaced; when the version promoted is the canary itself, the split forgets it and the
        ``canary`` alias, which named it, is dropped (the registry's canary stage is empty now).

        Each alias remembers the stable model it named before (``previous``), which the router
        keeps serving while no replica serves the new one yet.

        Runs inside the consumer's transaction, which also records the event id, so a redelivered
        event is skipped there. The registry publishes in order per stage (keyed by stage), so
        events of different stages may arrive out of order: each row keeps the ``occurred_at`` of
        the event that set its stable model and of the one that set its split, and an older event
        changes neither (a canary promoted before the current stable does not split it).
        """
        assert isinstance(event, events_pb2.ModelPromoted)
        stage = event.stage.strip()
        if not stage or not event.model.name:
            raise errors.ValidationError("stage" if not stage else "model.name", "is required")
        try:
            promoted = ModelRef.of(event.model)
        except ValueError as exc:
            raise errors.ValidationError("model", str(exc)) from None
        name, version = promoted.name, promoted.version
        at = _occurred_ns(event)
        if stage in CANARY_OF and event.is_rollback and not event.previous.name:
            await self._end_canary(session, stage, name, version, event.meta.event_id, at)
            return
        if stage in CANARY_OF and await self._promoted_after(session, CANARY_OF[stage], name, version, at):
            return  # arrived after its own promotion to production: the canary stage is empty
        for alias in (stage, PUBLIC_ALIASES.get(stage)):
            if alias is None:
                continue
            row = await session.get(ModelAliasRow, alias)
            if row is None:
                row = ModelAliasRow(
                    alias=alias, canary_model_name="", canary_model_version="", canary_weight=0
                )
                session.add(row)
            elif at < (row.source_at_ns or 0):
                continue  # a later promotion of this stage is already applied
            _set_stable(row, name, version)
            row.stage = stage
            row.source_event_id = event.meta.event_id
            row.source_at_ns = at
            row.updated_at = utcnow()
            if stage in CANARY_OF.values() and at >= (row.canary_at_ns or 0):
                row.canary_weight, row.canary_at_ns = 0, at
                if (row.canary_model_name, row.canary_model_version) == (name, version):
                    row.canary_model_name, row.canary_model_version = "", ""
        for canary_stage, base_stage in CANARY_OF.items():
            if base_stage == stage:
                await self._drop_stage_alias(session, canary_stage, name, version, at)
        base = CANARY_OF.get(stage)
        if base is not None:
            weight = 0 if event.is_rollback else min(100, event.traffic_percent)
            for alias in (base, PUBLIC_ALIASES.get(base)):
                row = await session.get(ModelAliasRow, alias) if alias else None
                if row is None:
                    continue  # nothing stable to split yet
                if at < max(row.source_at_ns or 0, row.canary_at_ns or 0):
                    continue  # promoted before the stable it would split, or a later split decided
                row.canary_model_name, row.canary_model_version = name, version
                row.canary_weight, row.canary_at_ns = weight, at
                row.updated_at = utcnow()
        self._cached.clear()

    async def _end_canary(
        self, session: AsyncSession, stage: str, name: str, version: str, event_id: str, at: int
    ) -> None:
        """A canary rolled back with nothing to restore (the guarded canary's rollback): the stage
        alias no longer names it and the aliases it split stop sending it traffic."""
        await self._drop_stage_alias(session, stage, name, version, at)
        base = CANARY_OF[stage]
        for alias in (base, PUBLIC_ALIASES.get(base)):
            split = await session.get(ModelAliasRow, alias) if alias else None
            if split is not None and (split.canary_model_name, split.canary_model_version) == (name, version):
                split.canary_weight = 0
                split.canary_at_ns = max(split.canary_at_ns or 0, at)
                split.source_event_id = event_id
                split.updated_at = utcnow()
        self._cached.clear()

    @staticmethod
    async def _promoted_after(session: AsyncSession, base: str, name: str, version: str, at: int) -> bool:
        """Whether ``base``'s alias names ``name:version`` by an event later than ``at``."""
        row = await session.get(ModelAliasRow, base)
        return (
            row is not None
            and (row.model_name, row.model_version) == (name, version)
            and (row.source_at_ns or 0) > at
        )

    @staticmethod
    async def _drop_stage_alias(session: AsyncSession, stage: str, name: str, version: str, at: int) -> None:
        """Delete the alias of ``stage`` if it still names ``name:version`` and no later event set it."""
        row = await session.get(ModelAliasRow, stage)
        if (
            row is not None
            and (row.model_name, row.model_version) == (name, version)
            and at >= (row.source_at_ns or 0)
        ):
            await session.delete(row)

    async def list_aliases(self) -> list[Alias]:
        async with self._db.session() as session:
            rows = (await session.scalars(sa.select(ModelAliasRow).order_by(ModelAliasRow.alias))).all()
        return [_alias(r) for r in rows]

    async def alias_named(self, alias: str) -> Alias | None:
        async def load() -> Alias | None:
            async with self._db.session() as session:
                row = await session.get(ModelAliasRow, alias)
            return _alias(row) if row is not None else None

        return await self._cached.get(alias, load)

    async def resolve_model(self, model: str) -> tuple[ModelRef, Alias | None]:
        """The model version ``model`` names (an alias's stable model, or the model reference
        itself) and the alias; a :class:`~forge_kit.errors.ValidationError` naming ``model`` when
        it is neither."""
        try:
            ref = ModelRef.parse(model)
        except ValueError as exc:
            raise errors.ValidationError("model", str(exc)) from None
        alias = None if ref.pinned else await self.alias_named(ref.name)
        return (alias.model, alias) if alias is not None else (ref, None)

    async def set_alias(self, alias: str, name: str, version: str) -> Alias:
        """Admin: pin ``alias`` to ``name[:version]`` (a deployment without the registry's events,
        e.g. a benchmark); the registry's next ``ModelPromoted`` for its stage replaces it."""
        if not _ALIAS.fullmatch(alias):
            raise errors.ValidationError("alias", "must be 1-64 of a-z, 0-9, '.', '_', '-'")
        if not name.strip():
            raise errors.ValidationError("model.name", "is required")
        try:
            ModelRef(name, version)
        except ValueError as exc:
            raise errors.ValidationError("model", str(exc)) from None
        async with self._db.session() as session:
            row = await session.get(ModelAliasRow, alias)
            if row is None:
                row = ModelAliasRow(
                    alias=alias, canary_model_name="", canary_model_version="", canary_weight=0
                )
                session.add(row)
            _set_stable(row, name, version)
            row.stage = "admin"
            row.source_event_id, row.source_at_ns = "", 0
            row.updated_at = utcnow()
            result = _alias(row)
        self._cached.clear()
        return result

    async def set_canary(self, alias: str, name: str, version: str, weight: int) -> Alias:
        """Admin: send ``weight`` percent of ``alias``'s traffic to ``name[:version]``."""
        if not name.strip():
            raise errors.ValidationError("model.name", "is required")
        try:
            ModelRef(name, version)
        except ValueError as exc:
            raise errors.ValidationError("model", str(exc)) from None
        if not 0 <= weight <= 100:
            raise errors.ValidationError("weight", f"must be 0-100, got {weight}")

        def apply(row: ModelAliasRow) -> None:
            row.canary_model_name, row.canary_model_version, row.canary_weight = name, version, weight

        return await self._update(alias, apply)

    async def set_shadow(self, alias: str, name: str, version: str, percent: int) -> Alias:
        """Admin: mirror ``percent`` of ``alias``'s stable traffic to ``name[:version]`` without
        serving its answers (0 stops it)."""
        if percent and not name.strip():
            raise errors.ValidationError("model.name", "is required")
        try:
            if name:
                ModelRef(name, version)
        except ValueError as exc:
            raise errors.ValidationError("model", str(exc)) from None
        if not 0 <= percent <= 100:
            raise errors.ValidationError("percent", f"must be 0-100, got {percent}")

        def apply(row: ModelAliasRow) -> None:
            row.shadow_model_name, row.shadow_model_version, row.shadow_percent = name, version, percent

        return await self._update(alias, apply)

    async def rollback_canary(self, alias: str) -> Alias:
        """Admin: all of ``alias``'s traffic back to its stable model at once (canary weight 0)."""

        def apply(row: ModelAliasRow) -> None:
            row.canary_weight = 0

        return await self._update(alias, apply)

    async def _update(self, alias: str, apply: Callable[[ModelAliasRow], None]) -> Alias:
        """Change ``alias``'s row in one transaction (404 when there is none) and drop the cache."""
        async with self._db.session() as session:
            row = await session.get(ModelAliasRow, alias)
            if row is None:
                raise errors.NotFoundError(f"alias {alias!r} not found")
            apply(row)
            row.updated_at = utcnow()
            result = _alias(row)
        self._cached.clear()
        return result
