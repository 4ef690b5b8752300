"""Rater accounts and browser sessions: Argon2id password hashes, session tokens stored as their
SHA-256, a short in-process cache of live sessions. Part of
:class:`~forge_preference_feedback.service.FeedbackService` (its :class:`RaterAccounts` base).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import sqlalchemy as sa
from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError

from forge_kit import errors
from forge_kit.db import Database
from forge_preference_feedback.store import RaterRow, SessionRow
from forge_preference_feedback.transactions import Transactions, UnitConnection

_RATER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$")
SESSION_CACHE_MAX = 10_000
MIN_PASSWORD = 8
MAX_PASSWORD = 256


@dataclass(frozen=True)
class Session:
    """A live login: who, whether they are an admin, and the CSRF token their forms must carry."""

    rater_id: str
    is_admin: bool
    csrf_token: str


def validate_rater(field: str, value: str) -> None:
    if not value:
        raise errors.ValidationError(field, "must not be empty")
    if not _RATER.match(value):
        raise errors.ValidationError(
            field, "must be letters, digits, '.', '_', '@' or '-', at most 128 characters"
        )


class RaterAccounts:
    """Accounts and sessions; the attributes below are set by ``FeedbackService.__init__``."""

    _db: Database
    _tx: Transactions
    _clock: Callable[[], dt.datetime]
    _hasher: PasswordHasher
    _new_token: Callable[[], str]
    _session_ttl: dt.timedelta
    _session_cache: dt.timedelta
    _sessions: dict[str, tuple[Session, dt.datetime]]
    _dummy_hash: str

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


def _token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()
