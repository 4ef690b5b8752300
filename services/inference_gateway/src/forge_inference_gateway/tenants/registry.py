"""Tenants: their API keys (stored as SHA-256 only), priority classes, per-minute rate limits and
whether they allow their prompts to be used for training (off unless the tenant opts in)."""

from __future__ import annotations

import hashlib
import re
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import sqlalchemy as sa

from forge_inference_gateway.caching.read_through import ReadThrough
from forge_inference_gateway.routing.admission import LEVELS
from forge_inference_gateway.store import TenantRow
from forge_kit import errors
from forge_kit.cache import Cache
from forge_kit.db import Database

PRIORITY_CLASSES = LEVELS
BOOTSTRAP_TENANT = "default"
_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


def hash_api_key(api_key: str) -> str:
    """What is stored for a key: its SHA-256, hex. Keys are random, so no salt or stretching is needed."""
    return hashlib.sha256(api_key.encode()).hexdigest()


def new_api_key() -> str:
    return f"fk-{secrets.token_urlsafe(32)}"


@dataclass(frozen=True)
class Tenant:
    id: str
    name: str
    priority_class: str
    rpm_limit: int
    allow_training: bool = False
    """Its prompts may be recorded for the RLHF prompt pool (:mod:`.training_prompts`)."""


def _tenant(row: TenantRow) -> Tenant:
    return Tenant(
        id=row.id,
        name=row.name,
        priority_class=row.priority_class,
        rpm_limit=row.rpm_limit,
        allow_training=bool(row.allow_training),
    )


class Tenants:
    """Who may call (step 1 of a request, :func:`authenticate`) and how often (step 2, :func:`admit`).

    Key lookups are kept ``ttl_s`` (:class:`~forge_inference_gateway.caching.read_through.ReadThrough`);
    the rate-limit buckets live in ``cache`` (Redis shared by every gateway replica, or in process).
    """

    def __init__(
        self,
        db: Database,
        cache: Cache,
        *,
        default_rpm_limit: int = 600,
        internal_token: str | None = None,
        ttl_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._db = db
        self._cache = cache
        self._default_rpm = default_rpm_limit
        self._internal_token = internal_token
        self._cached: ReadThrough[str, Tenant] = ReadThrough(ttl_s, clock)

    async def bootstrap(self, api_key: str) -> Tenant | None:
        """Create the ``default`` tenant with ``api_key``, or re-key it when the setting changed."""
        if not api_key:
            return None
        key_hash = hash_api_key(api_key)
        async with self._db.session() as session:
            row = await session.scalar(sa.select(TenantRow).where(TenantRow.name == BOOTSTRAP_TENANT))
            if row is None:
                row = TenantRow(
                    id=f"t-{uuid.uuid4().hex[:12]}",
                    name=BOOTSTRAP_TENANT,
                    key_hash=key_hash,
                    priority_class="interactive",
                    rpm_limit=self._default_rpm,
                )
                session.add(row)
            elif row.key_hash != key_hash:
                row.key_hash = key_hash
        self._cached.clear()
        return _tenant(row)

    async def create_tenant(
        self,
        name: str,
        priority_class: str = "interactive",
        rpm_limit: int | None = None,
        *,
        allow_training: bool = False,
    ) -> tuple[Tenant, str]:
        """A new tenant and its API key; the key is shown this once and only its hash is kept.
        Its prompts are used for training only when ``allow_training`` says so (off by default)."""
        if not _NAME.match(name):
            raise errors.ValidationError("name", "lower-case letters, digits and '-', at most 63 characters")
        if priority_class not in PRIORITY_CLASSES:
            raise errors.ValidationError("priority_class", f"must be one of {', '.join(PRIORITY_CLASSES)}")
        if rpm_limit is not None and rpm_limit < 1:
            raise errors.ValidationError("rpm_limit", f"must be at least 1, got {rpm_limit}")
        api_key = new_api_key()
        async with self._db.session() as session:
            if await session.scalar(sa.select(TenantRow.id).where(TenantRow.name == name)) is not None:
                raise errors.AlreadyExistsError(f"tenant {name!r} already exists")
            row = TenantRow(
                id=f"t-{uuid.uuid4().hex[:12]}",
                name=name,
                key_hash=hash_api_key(api_key),
                priority_class=priority_class,
                rpm_limit=rpm_limit or self._default_rpm,
                allow_training=allow_training,
            )
            session.add(row)
        return _tenant(row), api_key

    async def set_training(self, name: str, allowed: bool) -> Tenant:
        """Opt the tenant in to (or out of) training on its prompts. Opting out also keeps the
        prompts recorded before out of the pool (``TrainingPrompts.pool`` reads the flag)."""
        async with self._db.session() as session:
            row = await session.scalar(sa.select(TenantRow).where(TenantRow.name == name))
            if row is None:
                raise errors.NotFoundError(f"tenant {name!r} not found")
            row.allow_training = allowed
        self._cached.clear()
        return _tenant(row)

    async def list_tenants(self) -> list[Tenant]:
        async with self._db.session() as session:
            rows = (await session.scalars(sa.select(TenantRow).order_by(TenantRow.name))).all()
        return [_tenant(r) for r in rows]

    async def tenant_named(self, name: str) -> Tenant:
        async def load() -> Tenant:
            async with self._db.session() as session:
                row = await session.scalar(sa.select(TenantRow).where(TenantRow.name == name))
            if row is None:
                raise errors.NotFoundError(f"tenant {name!r} not found")
            return _tenant(row)

        return await self._cached.get(f"name:{name}", load)

    async def authenticate(self, api_key: str) -> Tenant:
        """The tenant of ``api_key``. The service's own token (platform callers) acts as ``default``."""
        if not api_key:
            raise errors.UnauthenticatedError("missing API key: send Authorization: Bearer <key>")
        if self._internal_token and secrets.compare_digest(api_key.encode(), self._internal_token.encode()):
            return await self.tenant_named(BOOTSTRAP_TENANT)
        key_hash = hash_api_key(api_key)

        async def load() -> Tenant:
            async with self._db.session() as session:
                row = await session.scalar(sa.select(TenantRow).where(TenantRow.key_hash == key_hash))
            if row is None:
                raise errors.UnauthenticatedError("invalid API key")
            return _tenant(row)

        return await self._cached.get(key_hash, load)

    async def admit(self, tenant: Tenant) -> None:
        """Take one request from the tenant's per-minute budget, or refuse with when to retry."""
        allowed, wait_s = await self._cache.allow(
            f"rpm:{tenant.id}", tenant.rpm_limit / 60.0, tenant.rpm_limit
        )
        if not allowed:
            raise errors.OverloadedError(
                f"tenant {tenant.name!r} is over its limit of {tenant.rpm_limit} requests per minute", wait_s
            )
