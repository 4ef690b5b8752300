"""Preference feedback domain logic: seeding comparisons, handing them to raters, recording
preferences, rater accounts, rater quality and training snapshots (the reward-model registry is
:mod:`.registry`).

A preference is written with its ``PreferenceRecorded`` event in one transaction (the outbox), so
no answer is lost while the broker is away.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import math
import re
import secrets
import shutil
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from itertools import islice
from pathlib import Path

import sqlalchemy as sa
from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError
from forge.common.v1 import common_pb2
from forge.events.v1 import events_pb2
from sqlalchemy.exc import IntegrityError

from forge_kit import errors
from forge_kit.db import Database
from forge_kit.events import stage_event_sync
from forge_preference_feedback.export import RatedPair, SnapshotManifest, write_snapshot
from forge_preference_feedback.quality import Label, QualityPolicy, QualityReport, assess_raters
from forge_preference_feedback.seeds import PreferencePair, arrange, stable_id
from forge_preference_feedback.store import (
    AsyncTransactions,
    ComparisonRow,
    HotPath,
    PreferenceRow,
    RaterRow,
    SessionRow,
    Transactions,
    UnitConnection,
    utcnow,
)

Choice = common_pb2.PreferenceChoice
CHOICES = frozenset(v for v in Choice.values() if v != Choice.PREFERENCE_CHOICE_UNSPECIFIED)
MAX_RATIONALE = 4000
_RATER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$")
SESSION_CACHE_MAX = 10_000
MIN_PASSWORD = 8
MAX_PASSWORD = 256
UI_VERSION_MAX = 32
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
class PreferenceStats:
    """Accepted pairs (A or B answers of raters not flagged): in all and recorded after ``since``."""

    accepted: int
    accepted_since: int
    last_recorded_at: dt.datetime | None
    excluded_raters: dict[str, list[str]]


@dataclass(frozen=True)
class StoredSnapshot:
    """A snapshot in the snapshot folder: where it is, what it holds, and whether this call wrote it."""

    path: Path
    manifest: SnapshotManifest
    created: bool


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
        transactions: Transactions | None = None,
        session_cache: dt.timedelta = dt.timedelta(seconds=5),
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
        self._tx = transactions or AsyncTransactions(db)
        self._session_cache = session_cache
        # token hash -> (session, remembered until); insertion-ordered, oldest evicted first.
        self._sessions: dict[str, tuple[Session, dt.datetime]] = {}
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
        return await self._tx.run(
            partial(self._next_comparison, rater_id=rater_id, now=self._clock()), serial=True
        )

    def _next_comparison(
        self, conn: UnitConnection, *, rater_id: str, now: dt.datetime
    ) -> ComparisonRow | None:
        # Answering closes the answerer's lease (see _record), so "live lease" means a rater
        # still looking at the item, and live leases are few (about one per active rater): each
        # step is driven by an index, not by the size of the history. Core statements built
        # once (HotPath): this runs for every item handed out.
        params = {"rid": rater_id, "now": now, "k": self._overlap}
        # 1.
        chosen = conn.execute(HotPath.held, params).first()
        if chosen is not None:
            return ComparisonRow(**chosen._mapping)
        # 2. Items no other rater holds first, else the least-held of the rest.
        chosen = (
            conn.execute(HotPath.free, params).first() or conn.execute(HotPath.held_by_others, params).first()
        )
        if chosen is None:
            return None
        # 3. Lease it (again, when an old lease of this rater on it ran out).
        until = now + self._lease
        if not conn.execute(
            HotPath.renew_lease, {"cid": chosen.id, "rid": rater_id, "lease_from": now, "lease_until": until}
        ).rowcount:
            conn.execute(
                HotPath.insert_lease,
                {"comparison_id": chosen.id, "rater_id": rater_id, "assigned_at": now, "expires_at": until},
            )
        return ComparisonRow(**chosen._mapping)

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
        record = partial(
            self._record,
            comparison_id=comparison_id,
            rater_id=rater_id,
            choice=choice,
            confidence=confidence,
            rationale=rationale,
            ui_version=ui_version,
            now=self._clock(),
        )
        try:
            row, created = await self._tx.run(record)
        except IntegrityError:
            # A concurrent identical submit won the race; answer as the retry it is.
            row, created = await self._tx.run(record)
        if created:
            self._on_commit()
        return row

    def _record(
        self,
        conn: UnitConnection,
        *,
        comparison_id: str,
        rater_id: str,
        choice: int,
        confidence: float,
        rationale: str,
        ui_version: str,
        now: dt.datetime,
    ) -> tuple[PreferenceRow, bool]:
        """The preference and its event in one transaction; ``(row, created)``. Core statements,
        as in :meth:`_next_comparison`."""
        key = {"cid": comparison_id, "rid": rater_id}
        comparison = conn.execute(HotPath.comparison, key).first()
        if comparison is None:
            raise errors.ValidationError("comparison_id", f"no comparison {comparison_id!r}")
        existing = conn.execute(HotPath.answer, key).first()
        if existing is not None:
            if (existing.choice, existing.rationale) == (choice, rationale) and abs(
                existing.confidence - confidence
            ) < 1e-6:
                return PreferenceRow(**existing._mapping), False
            raise errors.AlreadyExistsError(
                f"rater {rater_id!r} already answered comparison {comparison_id!r} (preference {existing.id})"
            )
        assignment = conn.execute(HotPath.lease, key).first()
        if assignment is None:
            raise errors.ValidationError(
                "comparison_id", f"comparison {comparison_id!r} was not assigned to rater {rater_id!r}"
            )
        values = {
            "comparison_id": comparison_id,
            "rater_id": rater_id,
            "id": f"pref-{uuid.uuid4().hex[:12]}",
            "choice": choice,
            "confidence": confidence,
            "rationale": rationale,
            "created_at": now,
            "shown_at": assignment.assigned_at,
            "ui_version": ui_version,
        }
        conn.execute(HotPath.insert_answer, values)
        # The answer ends the lease and counts toward the item's overlap (what assignment reads).
        if assignment.expires_at > now:
            conn.execute(HotPath.end_lease, {**key, "lease_until": now})
        conn.execute(HotPath.count_answer, key)
        row = PreferenceRow(**values)
        self._stage_recorded(conn, ComparisonRow(**comparison._mapping), row)
        return row, True

    def _stage_recorded(self, conn: UnitConnection, comparison: ComparisonRow, row: PreferenceRow) -> None:
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
        stage_event_sync(conn, event, producer=self._producer, key=comparison.id)

    async def progress(self, rater_id: str) -> Progress:
        """Answers the rater has given and comparisons still open to them (under the overlap)."""
        validate_rater("rater_id", rater_id)
        mine = sa.exists().where(
            PreferenceRow.comparison_id == ComparisonRow.id, PreferenceRow.rater_id == rater_id
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
                    .where(ComparisonRow.answer_count < self._overlap, ~mine)
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
            password_hash=await asyncio.to_thread(self._hasher.hash, password),
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
        hashed) and the session. A wrong name and a wrong password give the same error.

        Argon2 is deliberately slow (tens of milliseconds); it runs on a worker thread so that
        a login does not stall every other request on the event loop."""
        async with self._db.session() as session:
            rater = await session.get(RaterRow, rater_id) if _RATER.match(rater_id or "") else None
        if rater is None and not self._dummy_hash:
            # Verified against when the rater does not exist, so a miss costs as much as a hit.
            self._dummy_hash = await asyncio.to_thread(self._hasher.hash, "not-a-password")
        try:
            await asyncio.to_thread(
                self._hasher.verify, rater.password_hash if rater else self._dummy_hash, password
            )
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
        async with self._db.session() as session:
            session.add(row)
        return token, Session(rater.id, rater.is_admin, row.csrf_token)

    async def session_for(self, token: str) -> Session | None:
        """The live session of a cookie token, or None (unknown, expired or logged out).

        Every API call and page asks this, so a live session is remembered in this process for
        ``session_cache`` (never past its expiry): a logout takes effect at once in the process
        that handled it and within ``session_cache`` in any other replica."""
        if not token:
            return None
        token_hash, now = _token_hash(token), self._clock()
        cached = self._sessions.get(token_hash)
        if cached is not None and cached[1] > now:
            return cached[0]
        found = await self._tx.run(partial(self._session_for, token_hash=token_hash, now=now))
        if found is None:
            self._sessions.pop(token_hash, None)
            return None
        live, expires_at = found
        if self._session_cache > dt.timedelta(0):
            if len(self._sessions) >= SESSION_CACHE_MAX:
                self._sessions.pop(next(iter(self._sessions)))
            self._sessions[token_hash] = (live, min(expires_at, now + self._session_cache))
        return live

    @staticmethod
    def _session_for(
        conn: UnitConnection, *, token_hash: str, now: dt.datetime
    ) -> tuple[Session, dt.datetime] | None:
        row = conn.execute(
            sa.select(SessionRow.rater_id, SessionRow.csrf_token, SessionRow.expires_at, RaterRow.is_admin)
            .join(RaterRow, RaterRow.id == SessionRow.rater_id)
            .where(SessionRow.token_hash == token_hash, SessionRow.expires_at > now)
        ).first()
        return (Session(row.rater_id, row.is_admin, row.csrf_token), row.expires_at) if row else None

    async def logout(self, token: str) -> None:
        token_hash = _token_hash(token)
        self._sessions.pop(token_hash, None)
        async with self._db.session() as session:
            await session.execute(sa.delete(SessionRow).where(SessionRow.token_hash == token_hash))

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

    async def preference_stats(
        self, since: dt.datetime | None = None, policy: QualityPolicy = QualityPolicy()
    ) -> PreferenceStats:
        """How many accepted pairs there are, and how many were recorded after ``since``: the
        pairs a snapshot would hold (flagged raters' labels, ties and "both bad" left out)."""
        report = await self.rater_quality(policy)
        flagged = report.flagged()
        accepted: list[sa.ColumnElement[bool]] = [
            PreferenceRow.choice.in_([Choice.PREFERENCE_CHOICE_A, Choice.PREFERENCE_CHOICE_B])
        ]
        if flagged:
            accepted.append(PreferenceRow.rater_id.not_in(list(flagged)))
        newer = PreferenceRow.created_at > since if since is not None else sa.false()
        async with self._db.session() as session:
            total, fresh, last = (
                await session.execute(
                    sa.select(
                        sa.func.count(),
                        sa.func.coalesce(sa.func.sum(sa.case((newer, 1), else_=0)), 0),
                        sa.func.max(PreferenceRow.created_at),
                    ).where(*accepted)
                )
            ).one()
        return PreferenceStats(int(total), int(fresh), last, flagged)

    async def export_to_store(
        self, root: Path, *, heldout_fraction: float = 0.1, policy: QualityPolicy = QualityPolicy()
    ) -> StoredSnapshot:
        """Export a snapshot into ``root/<snapshot id>``. The id is a digest of the data, so the
        same data is one folder: a snapshot already there is returned (``created`` False) and the
        fresh copy discarded; a folder is never overwritten."""
        root.mkdir(parents=True, exist_ok=True)
        pending = root / f".pending-{uuid.uuid4().hex}"
        manifest = await self.export_snapshot(pending, heldout_fraction=heldout_fraction, policy=policy)
        final = root / manifest.snapshot_id
        try:
            pending.rename(final)
        except OSError:  # the same data was exported before: keep the first copy
            if not (final / "manifest.json").is_file():
                raise
            shutil.rmtree(pending, ignore_errors=True)
            return StoredSnapshot(final, manifest, created=False)
        return StoredSnapshot(final, manifest, created=True)

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


def _token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()
