"""Preference feedback domain logic: seeding comparisons, handing them to raters, recording
preferences, and the reward-model registry.

A preference is written with its ``PreferenceRecorded`` event in one transaction (the outbox), so
no answer is lost while the broker is away.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import math
import re
import secrets
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import sqlalchemy as sa
from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError
from forge.common.v1 import common_pb2
from forge.events.v1 import events_pb2
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from forge_kit import errors
from forge_kit.db import Database
from forge_kit.events import stage_event
from forge_preference_feedback.export import RatedPair, SnapshotManifest, write_snapshot
from forge_preference_feedback.quality import Label, QualityPolicy, QualityReport, assess_raters
from forge_preference_feedback.seeds import PreferencePair, arrange, stable_id
from forge_preference_feedback.store import (
    AssignmentRow,
    ComparisonRow,
    PreferenceRow,
    RaterRow,
    RewardModelRow,
    SessionRow,
    utcnow,
)

Choice = common_pb2.PreferenceChoice
CHOICES = frozenset(v for v in Choice.values() if v != Choice.PREFERENCE_CHOICE_UNSPECIFIED)
MAX_RATIONALE = 4000
_RATER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MIN_PASSWORD = 8
MAX_PASSWORD = 256
UI_VERSION_MAX = 32
REWARD_MODEL_STATUSES = ("candidate", "active", "retired")
# Quality labels: the proto's choices A, B, TIE, BOTH_BAD as 0..3.
QUALITY_CLASSES = 4
_GOLD = {"A": Choice.PREFERENCE_CHOICE_A, "B": Choice.PREFERENCE_CHOICE_B}


@dataclass(frozen=True)
class Session:
    """A live login: who, whether they are an admin, and the CSRF token their forms must carry."""

    rater_id: str
    is_admin: bool
    csrf_token: str


@dataclass(frozen=True)
class Progress:
    """How far a rater is: answers given, and comparisons still open to them."""

    answered: int
    remaining: int


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
        overlap: int = 3,
        session_ttl: dt.timedelta = dt.timedelta(hours=12),
        hasher: PasswordHasher | None = None,
        token_factory: Callable[[], str] = lambda: secrets.token_urlsafe(32),
        clock: Callable[[], dt.datetime] = utcnow,
        on_commit: Callable[[], None] = lambda: None,
    ) -> None:
        if overlap < 1:
            raise ValueError("overlap must be at least 1")
        self._db = db
        self._producer = producer
        self._lease = lease
        self._overlap = overlap
        self._session_ttl = session_ttl
        self._hasher = hasher or PasswordHasher()
        self._new_token = token_factory
        self._clock = clock
        self._on_commit = on_commit
        self._dummy_hash = ""

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
        shows the same item). 2. Otherwise the first comparison the rater has not answered and
        that does not yet have ``overlap`` raters (answers plus other raters' live leases),
        preferring ones no other rater holds a live lease on, then ones with fewer answers — so
        each item gets k independent answers, which agreement and Dawid–Skene need.
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
                    # A lease its holder has answered is counted once, as the answer.
                    ~sa.exists().where(
                        PreferenceRow.comparison_id == AssignmentRow.comparison_id,
                        PreferenceRow.rater_id == AssignmentRow.rater_id,
                    ),
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
                .where(ComparisonRow.id.not_in(answered), answers + leased_by_others < self._overlap)
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
        self,
        comparison_id: str,
        rater_id: str,
        choice: int,
        confidence: float,
        rationale: str,
        ui_version: str = "grpc",
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
        if len(ui_version) > UI_VERSION_MAX:
            raise errors.ValidationError("ui_version", f"must be at most {UI_VERSION_MAX} characters")
        args = (comparison_id, rater_id, choice, confidence, rationale, ui_version)
        try:
            return await self._record(*args)
        except IntegrityError:
            # A concurrent identical submit won the race; answer as the retry it is.
            return await self._record(*args)

    async def _record(
        self,
        comparison_id: str,
        rater_id: str,
        choice: int,
        confidence: float,
        rationale: str,
        ui_version: str,
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
            assignment = await session.get(AssignmentRow, (comparison_id, rater_id))
            if assignment is None:
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
                shown_at=assignment.assigned_at,
                ui_version=ui_version,
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

    async def progress(self, rater_id: str) -> Progress:
        """Answers the rater has given and comparisons still open to them (under the overlap)."""
        validate_rater("rater_id", rater_id)
        answered = sa.select(PreferenceRow.comparison_id).where(PreferenceRow.rater_id == rater_id)
        answers = (
            sa.select(sa.func.count())
            .where(PreferenceRow.comparison_id == ComparisonRow.id)
            .scalar_subquery()
        )
        async with self._db.session() as session:
            done = int(
                await session.scalar(
                    sa.select(sa.func.count())
                    .select_from(PreferenceRow)
                    .where(PreferenceRow.rater_id == rater_id)
                )
                or 0
            )
            open_ = int(
                await session.scalar(
                    sa.select(sa.func.count())
                    .select_from(ComparisonRow)
                    .where(ComparisonRow.id.not_in(answered), answers < self._overlap)
                )
                or 0
            )
        return Progress(answered=done, remaining=open_)

    # --- rater accounts and sessions ------------------------------------------------------------

    async def create_rater(self, rater_id: str, password: str, *, is_admin: bool = False) -> RaterRow:
        """Add a rater account; the password is stored only as an Argon2id hash."""
        validate_rater("rater_id", rater_id)
        if not MIN_PASSWORD <= len(password) <= MAX_PASSWORD:
            raise errors.ValidationError(
                "password", f"must be {MIN_PASSWORD} to {MAX_PASSWORD} characters long"
            )
        row = RaterRow(
            id=rater_id,
            password_hash=self._hasher.hash(password),
            is_admin=is_admin,
            created_at=self._clock(),
        )
        async with self._db.session() as session:
            if await session.get(RaterRow, rater_id) is not None:
                raise errors.AlreadyExistsError(f"rater {rater_id!r} already exists")
            session.add(row)
        return row

    async def login(self, rater_id: str, password: str) -> tuple[str, Session]:
        """Check the password and open a session; returns the cookie token (shown once, stored
        hashed) and the session. A wrong name and a wrong password give the same error."""
        async with self._db.session() as session:
            rater = await session.get(RaterRow, rater_id) if _RATER.match(rater_id or "") else None
            if rater is None and not self._dummy_hash:
                # Verified against when the rater does not exist, so a miss costs as much as a hit.
                self._dummy_hash = self._hasher.hash("not-a-password")
            try:
                self._hasher.verify(rater.password_hash if rater else self._dummy_hash, password)
            except (VerificationError, InvalidHashError):
                rater = None
            if rater is None:
                raise errors.UnauthenticatedError("unknown rater or wrong password")
            token, now = self._new_token(), self._clock()
            row = SessionRow(
                token_hash=_token_hash(token),
                rater_id=rater.id,
                csrf_token=secrets.token_urlsafe(32),
                created_at=now,
                expires_at=now + self._session_ttl,
            )
            session.add(row)
            return token, Session(rater.id, rater.is_admin, row.csrf_token)

    async def session_for(self, token: str) -> Session | None:
        """The live session of a cookie token, or None (unknown, expired or logged out)."""
        if not token:
            return None
        async with self._db.session() as session:
            row = await session.get(SessionRow, _token_hash(token))
            if row is None or row.expires_at <= self._clock():
                return None
            rater = await session.get(RaterRow, row.rater_id)
            if rater is None:
                return None
            return Session(rater.id, rater.is_admin, row.csrf_token)

    async def logout(self, token: str) -> None:
        async with self._db.session() as session:
            await session.execute(sa.delete(SessionRow).where(SessionRow.token_hash == _token_hash(token)))

    # --- rater quality ------------------------------------------------------------------------

    async def rater_quality(self, policy: QualityPolicy = QualityPolicy()) -> QualityReport:
        """Quality of every rater over all preferences recorded so far (see :mod:`.quality`)."""
        async with self._db.session() as session:
            rows = (
                await session.execute(
                    sa.select(
                        PreferenceRow.comparison_id,
                        PreferenceRow.rater_id,
                        PreferenceRow.choice,
                        PreferenceRow.created_at,
                        PreferenceRow.shown_at,
                    )
                )
            ).all()
            golds = (
                await session.execute(
                    sa.select(ComparisonRow.id, ComparisonRow.gold_choice).where(
                        ComparisonRow.id.in_({r.comparison_id for r in rows}), ComparisonRow.gold_choice != ""
                    )
                )
            ).all()
        labels = [
            Label(
                r.comparison_id,
                r.rater_id,
                r.choice - 1,
                (r.created_at - r.shown_at).total_seconds() if r.shown_at else float("nan"),
            )
            for r in rows
        ]
        gold = {g.id: _GOLD[g.gold_choice] - 1 for g in golds if g.gold_choice in _GOLD}
        return assess_raters(labels, QUALITY_CLASSES, gold, policy)

    async def export_snapshot(
        self, out: Path, *, heldout_fraction: float = 0.1, policy: QualityPolicy = QualityPolicy()
    ) -> SnapshotManifest:
        """Write the accepted A/B pairs as a training snapshot (see :mod:`.export`).

        1. Assess the raters; flagged raters' labels are excluded, with the reasons in the manifest.
        2. Ties and "both bad" carry no preference between the two responses and are left out
           (counted). 3. Everything else is written with its rater's weight.
        """
        # 1.
        report = await self.rater_quality(policy)
        excluded_raters = report.flagged()
        weights = {q.rater: q.weight for q in report.raters}
        # 2-3.
        excluded: Counter[str] = Counter()
        pairs: list[RatedPair] = []
        async with self._db.session() as session:
            rows = (
                await session.execute(
                    sa.select(PreferenceRow, ComparisonRow)
                    .join(ComparisonRow, ComparisonRow.id == PreferenceRow.comparison_id)
                    .order_by(PreferenceRow.created_at, PreferenceRow.id)
                )
            ).all()
        for pref, comparison in rows:
            if pref.choice not in (Choice.PREFERENCE_CHOICE_A, Choice.PREFERENCE_CHOICE_B):
                excluded["tie_or_both_bad"] += 1
                continue
            a, b = comparison.response_a_text, comparison.response_b_text
            chosen, rejected = (a, b) if pref.choice == Choice.PREFERENCE_CHOICE_A else (b, a)
            pairs.append(
                RatedPair(
                    pref.id,
                    comparison.id,
                    pref.rater_id,
                    comparison.prompt,
                    chosen,
                    rejected,
                    pref.created_at.isoformat(),
                )
            )
        return write_snapshot(
            pairs,
            out,
            heldout_fraction=heldout_fraction,
            excluded_raters=excluded_raters,
            excluded=excluded,
            weights=weights,
        )

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

    async def set_reward_model_status(self, name: str, version: str, status: str) -> RewardModelRow:
        """Move a reward-model version between candidate, active and retired. Making one version
        active retires the previously active version of that name, so ``active`` names one model."""
        if status not in REWARD_MODEL_STATUSES:
            raise errors.ValidationError("status", f"must be one of {', '.join(REWARD_MODEL_STATUSES)}")
        async with self._db.session() as session:
            row = await session.get(RewardModelRow, (name, version))
            if row is None:
                raise errors.NotFoundError(f"reward model {name}:{version} not found")
            if status == "active":
                await session.execute(
                    sa.update(RewardModelRow)
                    .where(RewardModelRow.name == name, RewardModelRow.status == "active")
                    .values(status="retired")
                )
            row.status = status
        return row


def _token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()
