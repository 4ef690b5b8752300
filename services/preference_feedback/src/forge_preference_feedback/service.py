"""Preference feedback domain logic: seeding comparisons, handing them to raters, recording
preferences, and the reward-model registry.

A preference is written with its ``PreferenceRecorded`` event in one transaction (the outbox), so
no answer is lost while the broker is away.
"""

from __future__ import annotations

import datetime as dt
import math
import re
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from itertools import islice

import sqlalchemy as sa
from forge.common.v1 import common_pb2
from forge.events.v1 import events_pb2
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from forge_kit import errors
from forge_kit.db import Database
from forge_kit.events import stage_event
from forge_preference_feedback.seeds import PreferencePair, arrange, stable_id
from forge_preference_feedback.store import (
    AssignmentRow,
    ComparisonRow,
    PreferenceRow,
    RewardModelRow,
    utcnow,
)

Choice = common_pb2.PreferenceChoice
CHOICES = frozenset(v for v in Choice.values() if v != Choice.PREFERENCE_CHOICE_UNSPECIFIED)
MAX_RATIONALE = 4000
_RATER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class SeedResult:
    """Outcome of a seed: comparisons added now and those that were already there."""

    added: int
    already_present: int


def validate_rater(field: str, value: str) -> None:
    if not value:
        raise errors.ValidationError(field, "must not be empty")
    if not _RATER.match(value):
        raise errors.ValidationError(
            field, "must be letters, digits, '.', '_', '@' or '-', at most 128 characters"
        )


class FeedbackService:
    """Owns the feedback database; every public method is one transaction."""

    def __init__(
        self,
        db: Database,
        *,
        producer: str = "preference_feedback",
        lease: dt.timedelta = dt.timedelta(minutes=10),
        clock: Callable[[], dt.datetime] = utcnow,
        on_commit: Callable[[], None] = lambda: None,
    ) -> None:
        self._db = db
        self._producer = producer
        self._lease = lease
        self._clock = clock
        self._on_commit = on_commit

    # --- comparisons -------------------------------------------------------------------------

    async def seed_comparisons(
        self, pairs: Iterable[PreferencePair], *, limit: int, rng_seed: int
    ) -> SeedResult:
        """Make the first ``limit`` pairs comparisons; pairs seeded before are left as they are."""
        if limit < 1:
            raise errors.ValidationError("limit", "must be at least 1")
        wanted = list(islice(pairs, limit))
        async with self._db.session() as session:
            keys = [p.key for p in wanted]
            present = set(
                (
                    await session.scalars(
                        sa.select(ComparisonRow.source_key).where(ComparisonRow.source_key.in_(keys))
                    )
                ).all()
            )
            seq = int(await session.scalar(sa.select(sa.func.max(ComparisonRow.seq))) or 0)
            now = self._clock()
            for pair in wanted:
                if pair.key in present:
                    continue
                seq += 1
                shown = arrange(pair, rng_seed)
                session.add(
                    ComparisonRow(
                        id=stable_id("cmp", pair.key),
                        seq=seq,
                        source=pair.source,
                        source_key=pair.key,
                        prompt=pair.prompt,
                        response_a_id=stable_id("rsp", pair.key, "a"),
                        response_a_text=shown.response_a,
                        response_a_model=pair.source,
                        response_b_id=stable_id("rsp", pair.key, "b"),
                        response_b_text=shown.response_b,
                        response_b_model=pair.source,
                        gold_choice=shown.gold,
                        created_at=now,
                    )
                )
        return SeedResult(added=len(wanted) - len(present), already_present=len(present))

    async def get_comparison(self, comparison_id: str) -> ComparisonRow:
        async with self._db.session() as session:
            row = await session.get(ComparisonRow, comparison_id)
            if row is None:
                raise errors.NotFoundError(f"comparison {comparison_id!r} not found")
            return row

    async def next_comparison(self, rater_id: str) -> ComparisonRow | None:
        """The comparison this rater should answer next, reserved for them for the lease.

        1. A comparison already leased to the rater and not yet answered comes back (a reload
        shows the same item). 2. Otherwise the first comparison the rater has not answered,
        preferring ones no other rater holds a live lease on, then ones with fewer answers.
        3. Record the lease.
        """
        validate_rater("rater_id", rater_id)
        now = self._clock()
        answered = sa.select(PreferenceRow.comparison_id).where(PreferenceRow.rater_id == rater_id)
        async with self._db.session() as session:
            held = await session.scalar(
                sa.select(ComparisonRow)
                .join(AssignmentRow, AssignmentRow.comparison_id == ComparisonRow.id)
                .where(
                    AssignmentRow.rater_id == rater_id,
                    AssignmentRow.expires_at > now,
                    ComparisonRow.id.not_in(answered),
                )
                .order_by(AssignmentRow.assigned_at, ComparisonRow.seq)
            )
            if held is not None:
                return held
            leased_by_others = (
                sa.select(sa.func.count())
                .where(
                    AssignmentRow.comparison_id == ComparisonRow.id,
                    AssignmentRow.rater_id != rater_id,
                    AssignmentRow.expires_at > now,
                )
                .scalar_subquery()
            )
            answers = (
                sa.select(sa.func.count())
                .where(PreferenceRow.comparison_id == ComparisonRow.id)
                .scalar_subquery()
            )
            chosen = await session.scalar(
                sa.select(ComparisonRow)
                .where(ComparisonRow.id.not_in(answered))
                .order_by(leased_by_others, answers, ComparisonRow.seq)
                .limit(1)
            )
            if chosen is None:
                return None
            assignment = await session.get(AssignmentRow, (chosen.id, rater_id))
            if assignment is None:
                session.add(
                    AssignmentRow(
                        comparison_id=chosen.id,
                        rater_id=rater_id,
                        assigned_at=now,
                        expires_at=now + self._lease,
                    )
                )
            else:
                assignment.assigned_at, assignment.expires_at = now, now + self._lease
            return chosen

    # --- preferences -------------------------------------------------------------------------

    async def submit_preference(
        self, comparison_id: str, rater_id: str, choice: int, confidence: float, rationale: str
    ) -> PreferenceRow:
        """Record a rater's answer with its event. The same answer posted again (a retry, a double
        click) returns the first record; a different answer to the same comparison is refused."""
        if not comparison_id:
            raise errors.ValidationError("comparison_id", "must not be empty")
        validate_rater("rater_id", rater_id)
        if choice not in CHOICES:
            raise errors.ValidationError("choice", "must be A, B, TIE or BOTH_BAD")
        if not math.isfinite(confidence) or not 0.0 <= confidence <= 1.0:
            raise errors.ValidationError("confidence", "must be between 0 and 1")
        if len(rationale) > MAX_RATIONALE:
            raise errors.ValidationError("rationale", f"must be at most {MAX_RATIONALE} characters")
        try:
            return await self._record(comparison_id, rater_id, choice, confidence, rationale)
        except IntegrityError:
            # A concurrent identical submit won the race; answer as the retry it is.
            return await self._record(comparison_id, rater_id, choice, confidence, rationale)

    async def _record(
        self, comparison_id: str, rater_id: str, choice: int, confidence: float, rationale: str
    ) -> PreferenceRow:
        async with self._db.session() as session:
            comparison = await session.get(ComparisonRow, comparison_id)
            if comparison is None:
                raise errors.ValidationError("comparison_id", f"no comparison {comparison_id!r}")
            existing = await session.scalar(
                sa.select(PreferenceRow).where(
                    PreferenceRow.comparison_id == comparison_id, PreferenceRow.rater_id == rater_id
                )
            )
            if existing is not None:
                if (existing.choice, existing.rationale) == (choice, rationale) and abs(
                    existing.confidence - confidence
                ) < 1e-6:
                    return existing
                raise errors.AlreadyExistsError(
                    f"rater {rater_id!r} already answered comparison {comparison_id!r} (preference {existing.id})"
                )
            if await session.get(AssignmentRow, (comparison_id, rater_id)) is None:
                raise errors.ValidationError(
                    "comparison_id", f"comparison {comparison_id!r} was not assigned to rater {rater_id!r}"
                )
            row = PreferenceRow(
                id=f"pref-{uuid.uuid4().hex[:12]}",
                comparison_id=comparison_id,
                rater_id=rater_id,
                choice=choice,
                confidence=confidence,
                rationale=rationale,
                created_at=self._clock(),
            )
            session.add(row)
            await session.flush()
            await self._stage_recorded(session, comparison, row)
        self._on_commit()
        return row

    async def _stage_recorded(
        self, session: AsyncSession, comparison: ComparisonRow, row: PreferenceRow
    ) -> None:
        a = (comparison.response_a_id, comparison.response_a_text)
        b = (comparison.response_b_id, comparison.response_b_text)
        chosen, rejected = (b, a) if row.choice == Choice.PREFERENCE_CHOICE_B else (a, b)
        event = events_pb2.PreferenceRecorded(
            preference_id=row.id,
            comparison_id=comparison.id,
            rater_id=row.rater_id,
            prompt=comparison.prompt,
            chosen_response_id=chosen[0],
            rejected_response_id=rejected[0],
            choice=row.choice,  # type: ignore[arg-type]
            confidence=row.confidence,
            chosen_text=chosen[1],
            rejected_text=rejected[1],
        )
        await stage_event(session, event, producer=self._producer, key=comparison.id)

    # --- reward models -----------------------------------------------------------------------

    async def register_reward_model(
        self, name: str, version: str, uri: str, metrics: Mapping[str, float]
    ) -> RewardModelRow:
        """Add an immutable reward-model version; an empty version takes the next integer."""
        if not name:
            raise errors.ValidationError("ref.name", "must not be empty")
        if not _NAME.match(name):
            raise errors.ValidationError(
                "ref.name", "must be letters, digits, '.', '_' or '-', at most 128 characters"
            )
        if version and not _VERSION.match(version):
            raise errors.ValidationError(
                "ref.version", "must be letters, digits, '.', '_' or '-', at most 64 characters"
            )
        if not uri.strip():
            raise errors.ValidationError("uri", "must not be empty")
        for key, value in metrics.items():
            if not key:
                raise errors.ValidationError("metrics", "names must not be empty")
            if not math.isfinite(value):
                raise errors.ValidationError(f"metrics.{key}", "must be finite")
        async with self._db.session() as session:
            if not version:
                existing = (
                    await session.scalars(
                        sa.select(RewardModelRow.version).where(RewardModelRow.name == name)
                    )
                ).all()
                version = str(max((int(v) for v in existing if v.isdigit()), default=0) + 1)
            elif await session.get(RewardModelRow, (name, version)) is not None:
                raise errors.AlreadyExistsError(f"reward model {name}:{version} is already registered")
            row = RewardModelRow(
                name=name, version=version, uri=uri, metrics=dict(metrics), created_at=self._clock()
            )
            session.add(row)
        return row

    async def list_reward_models(
        self, name: str, page_size: int, offset: int
    ) -> tuple[list[RewardModelRow], int]:
        query = sa.select(RewardModelRow)
        if name:
            query = query.where(RewardModelRow.name == name)
        async with self._db.session() as session:
            total = int(await session.scalar(sa.select(sa.func.count()).select_from(query.subquery())) or 0)
            rows = (
                await session.scalars(
                    query.order_by(
                        RewardModelRow.created_at.desc(), RewardModelRow.name, RewardModelRow.version.desc()
                    )
                    .offset(offset)
                    .limit(page_size)
                )
            ).all()
        return list(rows), total
