"""Preference feedback domain logic: seeding comparisons, queueing comparisons of an online RLHF
round (the policy's own samples) or of canary shadow traffic, handing them to raters and recording
preferences. Rater accounts are :mod:`.accounts`, rater quality, counts and snapshots
:mod:`.data`, the reward-model registry :mod:`.registry`.

A preference is written with its ``PreferenceRecorded`` event in one transaction (the outbox), so
no answer is lost while the broker is away.
"""

from __future__ import annotations

import datetime as dt
import math
import random
import re
import secrets
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import islice

import sqlalchemy as sa
from argon2 import PasswordHasher
from forge.common.v1 import common_pb2
from forge.events.v1 import events_pb2
from sqlalchemy.exc import IntegrityError

from forge_kit import errors
from forge_kit.db import Database
from forge_kit.events import stage_event_sync
from forge_preference_feedback.accounts import RaterAccounts, Session, validate_rater
from forge_preference_feedback.data import PreferenceData, PreferenceStats, StoredSnapshot
from forge_preference_feedback.seeds import PreferencePair, arrange, stable_id
from forge_preference_feedback.store import (
    ComparisonRow,
    HotPath,
    PreferenceRow,
    utcnow,
)
from forge_preference_feedback.transactions import AsyncTransactions, Transactions, UnitConnection

__all__ = [
    "FeedbackService",
    "NewComparison",
    "PreferenceStats",
    "Progress",
    "SeedResult",
    "Session",
    "StoredSnapshot",
    "validate_rater",
]

Choice = common_pb2.PreferenceChoice
CHOICES = frozenset(v for v in Choice.values() if v != Choice.PREFERENCE_CHOICE_UNSPECIFIED)
MAX_RATIONALE = 4000
UI_VERSION_MAX = 32
ORIGINS = ("policy", "shadow")
"""Origins of queued comparisons besides ``seed`` (the seeded data sets)."""
MAX_NEW_COMPARISONS = 1000
MAX_TEXT = 20_000
"""Longest prompt or response a queued comparison may hold (characters)."""
_BATCH = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@-]{0,127}$")
_KEY = re.compile(r"^[A-Za-z0-9._:/@-]{1,100}$")
_MODEL_MAX = 255


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


@dataclass(frozen=True)
class NewComparison:
    """A comparison to queue (:meth:`FeedbackService.add_comparisons`): two responses to one
    prompt, with who wrote each."""

    key: str
    prompt: str
    response_1: str
    model_1: str
    response_2: str
    model_2: str


class FeedbackService(RaterAccounts, PreferenceData):
    """Owns the feedback database; every public method is one transaction. Accounts and sessions
    are :class:`~.accounts.RaterAccounts`, quality, counts and snapshots :class:`~.data.PreferenceData`."""

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
                        origin="seed",
                        created_at=now,
                    )
                )
        return SeedResult(added=len(wanted) - len(present), already_present=len(present))

    async def add_comparisons(
        self, batch: str, origin: str, items: Sequence[NewComparison], *, rng_seed: int = 0
    ) -> SeedResult:
        """Queue comparisons made outside the seed data under ``batch`` (an online round's samples
        of the current policy, canary shadow pairs). Which response is shown as A is drawn per
        item, as for seeds; there is no gold answer. Keys already queued in the batch are left as
        they are (a retried call adds nothing). Raters get them like any other comparison, with the
        same overlap and lease rules, but ahead of everything queued before (their ``seq`` is below
        every other): an online round waits on its own samples, the newest batch first."""
        if not _BATCH.match(batch or ""):
            raise errors.ValidationError(
                "batch", "must be 1-128 letters, digits or '._:/@-', starting with a letter or digit"
            )
        if origin not in ORIGINS:
            raise errors.ValidationError("origin", f"must be one of {', '.join(ORIGINS)}")
        if not 1 <= len(items) <= MAX_NEW_COMPARISONS:
            raise errors.ValidationError("comparisons", f"must hold 1 to {MAX_NEW_COMPARISONS} comparisons")
        keys: set[str] = set()
        for i, item in enumerate(items):
            where = f"comparisons[{i}]"
            if not _KEY.match(item.key):
                raise errors.ValidationError(f"{where}.key", "must be 1-100 letters, digits or '._:/@-'")
            if item.key in keys:
                raise errors.ValidationError(f"{where}.key", f"{item.key!r} appears twice")
            keys.add(item.key)
            for name in ("prompt", "response_1", "response_2"):
                text = getattr(item, name)
                if not text.strip() or len(text) > MAX_TEXT:
                    raise errors.ValidationError(f"{where}.{name}", f"must be 1 to {MAX_TEXT} characters")
                if "\x00" in text:
                    raise errors.ValidationError(f"{where}.{name}", "must not contain NUL characters")
            for name in ("model_1", "model_2"):
                if len(getattr(item, name)) > _MODEL_MAX or "\x00" in getattr(item, name):
                    raise errors.ValidationError(
                        f"{where}.{name}", f"must be at most {_MODEL_MAX} characters"
                    )
        source = f"{origin}:{batch}"
        wanted = {f"{source}/{item.key}": item for item in items}
        async with self._db.session() as session:
            present = set(
                (
                    await session.scalars(
                        sa.select(ComparisonRow.source_key).where(ComparisonRow.source_key.in_(list(wanted)))
                    )
                ).all()
            )
            fresh = [key for key in wanted if key not in present]
            seq = int(await session.scalar(sa.select(sa.func.min(ComparisonRow.seq))) or 1) - len(fresh) - 1
            now = self._clock()
            for key in fresh:
                item = wanted[key]
                seq += 1
                # A coin per item (seeded by its key, as seeds.arrange does): the side says nothing.
                one = (item.response_1, item.model_1)
                two = (item.response_2, item.model_2)
                (a, a_model), (b, b_model) = (
                    (one, two) if random.Random(f"{rng_seed}:{key}").random() < 0.5 else (two, one)
                )
                session.add(
                    ComparisonRow(
                        id=stable_id("cmp", key),
                        seq=seq,
                        source=source[:128],
                        source_key=key,
                        prompt=item.prompt,
                        response_a_id=stable_id("rsp", key, "a"),
                        response_a_text=a,
                        response_a_model=a_model,
                        response_b_id=stable_id("rsp", key, "b"),
                        response_b_text=b,
                        response_b_model=b_model,
                        gold_choice="",
                        origin=origin,
                        batch=batch,
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
