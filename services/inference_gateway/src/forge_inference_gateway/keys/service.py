"""The key lifecycle: several API keys per tenant, each with scopes, an optional expiry, revocation,
rotation with an overlap window, usage counts, and an audit record of every change.

Who calls what:

* every ``/v1`` request: :meth:`ApiKeys.authenticate` (the secret → the tenant and the key's grant),
  then :func:`require_scope` on the route, then :meth:`ApiKeys.record` for what it used;
* admins (``/admin/v1/tenants/{name}/keys…``, ``forge tenants``): create, list, rotate, revoke,
  audit.

A tenant's first key — the one ``POST /admin/v1/tenants`` shows once, or the bootstrap key — lives
on the tenant row and has every scope. On its first use, or the first time an admin manages the
tenant's keys, it is adopted into the key table as ``primary`` (same secret, so nothing breaks),
and from then on it is counted, rotates, expires and is revoked like any other. The bootstrap key is configuration: a gateway
started with ``bootstrap_api_key`` set re-keys the ``default`` tenant with it.

Expiry is checked on every request against the clock; a revocation applies at once on the replica
that made it and within ``ttl_s`` on the others (keys are cached that long, as tenants are).
Usage is counted in memory and added to the key rows by :meth:`ApiKeys.flush` (every few seconds,
at shutdown, and before usage is read), so a request costs no database write.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import sqlalchemy as sa
from prometheus_client import Counter

from forge_inference_gateway.caching.read_through import ReadThrough
from forge_inference_gateway.keys.rows import ApiKeyRow, KeyAuditRow
from forge_inference_gateway.store import TenantRow
from forge_inference_gateway.tenants.registry import Tenant, Tenants, hash_api_key, new_api_key
from forge_kit import errors
from forge_kit.db import Database

SCOPES = ("inference", "rag:read", "rag:write", "embeddings")
PRIMARY = "primary"
PREFIX_CHARS = 10
MAX_KEYS_PER_TENANT = 50
MAX_OVERLAP_S = 30 * 86400
MAX_LIFETIME_S = 5 * 365 * 86400

KEY_USAGE = Counter(
    "forge_gateway_key_usage_total",
    "What each API key was used for: requests, tokens (prompt + completion), documents written",
    ["tenant", "key", "kind"],
)


@dataclass(frozen=True)
class KeyGrant:
    """What the key a request came with allows; ``id`` is empty for the service's own token."""

    id: str
    scopes: frozenset[str]
    expires_at: float | None = None


#: The grant of the service token and of a tenant's key not yet adopted: every scope.
FULL = frozenset(SCOPES)


@dataclass(frozen=True)
class KeyView:
    """A key as admins and its tenant see it: never the secret, never its hash."""

    id: str
    name: str
    prefix: str
    scopes: list[str]
    state: str
    """``active``, ``expired`` or ``revoked``."""
    created_at: str
    expires_at: str | None
    revoked_at: str | None
    last_used_at: str | None
    rotated_from: str
    usage: dict[str, int]


def check_scopes(raw: Iterable[str] | None) -> frozenset[str]:
    if raw is None:
        return FULL
    scopes = frozenset(raw)
    unknown = sorted(scopes - FULL)
    if unknown:
        raise errors.ValidationError("scopes", f"unknown scope {unknown[0]!r}; known: {', '.join(SCOPES)}")
    if not scopes:
        raise errors.ValidationError("scopes", "must name at least one scope")
    return scopes


def _iso(value: dt.datetime | None) -> str | None:
    return value.replace(tzinfo=dt.UTC).isoformat() if value is not None else None


class ApiKeys:
    """See the module docstring. ``now`` is the wall clock (Unix seconds), injected for tests."""

    def __init__(
        self,
        db: Database,
        tenants: Tenants,
        *,
        ttl_s: float = 5.0,
        now: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._db = db
        self._tenants = tenants
        self._now = now
        self._cached: ReadThrough[str, tuple[str, KeyGrant]] = ReadThrough(ttl_s, monotonic)
        self._pending: dict[str, list[int]] = {}
        self._last_used: dict[str, float] = {}

    def _at(self, seconds: float) -> dt.datetime:
        return dt.datetime.fromtimestamp(seconds, dt.UTC).replace(tzinfo=None)

    def _state(self, row: ApiKeyRow) -> str:
        if row.revoked_at is not None:
            return "revoked"
        if row.expires_at is not None and row.expires_at <= self._at(self._now()):
            return "expired"
        return "active"

    # --- every request ----------------------------------------------------------------------

    async def authenticate(self, api_key: str) -> tuple[Tenant, KeyGrant]:
        """The tenant and grant of ``api_key``; 401 for an unknown, expired or revoked key."""
        if not api_key:
            raise errors.UnauthenticatedError("missing API key: send Authorization: Bearer <key>")
        key_hash = hash_api_key(api_key)

        async def load() -> tuple[str, KeyGrant]:
            """The key's tenant name ("": resolve the secret through the tenants) and grant."""
            async with self._db.session() as session:
                found = (
                    await session.execute(
                        sa.select(ApiKeyRow, TenantRow.name)
                        .join(TenantRow, TenantRow.id == ApiKeyRow.tenant_id)
                        .where(ApiKeyRow.key_hash == key_hash)
                    )
                ).first()
            if found is None:
                # The service token (every scope, no key of its own), or a tenant's first key,
                # adopted now so that its use is counted like any other key's.
                tenant = await self._tenants.authenticate(api_key)
                adopted = await self._adopt_on_first_use(api_key)
                return (tenant.name, KeyGrant(adopted, FULL)) if adopted else ("", KeyGrant("", FULL))
            row, tenant_name = found
            if row.revoked_at is not None:
                raise errors.UnauthenticatedError("this API key was revoked")
            expires = row.expires_at.replace(tzinfo=dt.UTC).timestamp() if row.expires_at else None
            return tenant_name, KeyGrant(row.id, frozenset(row.scopes.split()), expires)

        name, grant = await self._cached.get(key_hash, load)
        if grant.expires_at is not None and grant.expires_at <= self._now():
            raise errors.UnauthenticatedError("this API key has expired")
        # The tenant itself (limits, training opt-in) as the tenants' own cache holds it now.
        tenant = await (self._tenants.tenant_named(name) if name else self._tenants.authenticate(api_key))
        return tenant, grant

    def record(
        self, tenant: Tenant, grant: KeyGrant, *, requests: int = 0, tokens: int = 0, documents: int = 0
    ) -> None:
        """Count what a request used against its key (in memory until :meth:`flush`)."""
        name = grant.id or PRIMARY
        for kind, amount in (("requests", requests), ("tokens", tokens), ("documents", documents)):
            if amount:
                KEY_USAGE.labels(tenant.name, name, kind).inc(amount)
        if not grant.id:
            return
        counts = self._pending.setdefault(grant.id, [0, 0, 0])
        counts[0] += requests
        counts[1] += tokens
        counts[2] += documents
        if requests:
            self._last_used[grant.id] = self._now()

    async def flush(self) -> None:
        """Add the counted usage to the key rows."""
        pending, self._pending = self._pending, {}
        last_used, self._last_used = self._last_used, {}
        if not pending:
            return
        async with self._db.session() as session:
            for key_id, (requests, tokens, documents) in pending.items():
                values: dict[str, object] = {
                    "requests": ApiKeyRow.requests + requests,
                    "tokens": ApiKeyRow.tokens + tokens,
                    "documents": ApiKeyRow.documents + documents,
                }
                if key_id in last_used:
                    values["last_used_at"] = self._at(last_used[key_id])
                await session.execute(sa.update(ApiKeyRow).where(ApiKeyRow.id == key_id).values(**values))

    # --- admins -----------------------------------------------------------------------------

    async def _tenant_row(self, session: object, name: str) -> TenantRow:
        row = await session.scalar(sa.select(TenantRow).where(TenantRow.name == name))  # type: ignore[attr-defined]
        if row is None:
            raise errors.NotFoundError(f"tenant {name!r} not found")
        return row  # type: ignore[no-any-return]

    async def _adopt_on_first_use(self, api_key: str) -> str | None:
        """Adopt the tenant key ``api_key`` is (None: it is no tenant's key, or was adopted by
        another replica at the same moment — the next lookup finds that row)."""
        try:
            async with self._db.session() as session:
                tenant = await session.scalar(
                    sa.select(TenantRow).where(TenantRow.key_hash == hash_api_key(api_key))
                )
                if tenant is None:
                    return None
                return await self._adopt(session, tenant, "first use", api_key[:PREFIX_CHARS])
        except sa.exc.IntegrityError:
            return None

    async def _adopt(self, session: object, tenant: TenantRow, actor: str, prefix: str = "") -> str | None:
        """Move the tenant's first key into the key table as ``primary`` (same secret); its id, or
        None when the tenant already has a ``primary``."""
        held = await session.scalar(  # type: ignore[attr-defined]
            sa.select(ApiKeyRow.id).where(ApiKeyRow.tenant_id == tenant.id, ApiKeyRow.name == PRIMARY)
        )
        if held is not None or await session.scalar(  # type: ignore[attr-defined]
            sa.select(ApiKeyRow.id).where(ApiKeyRow.key_hash == tenant.key_hash)
        ):
            return None
        row = self._new_row(tenant.id, PRIMARY, FULL, tenant.key_hash, prefix, None)
        session.add(row)  # type: ignore[attr-defined]
        # The tenant row keeps a hash no secret has, so the key answers only through its new row.
        tenant.key_hash = hash_api_key(new_api_key())
        self._audit(session, tenant.id, row.id, "adopted", actor, {"name": PRIMARY})
        return row.id

    def _new_row(
        self,
        tenant_id: str,
        name: str,
        scopes: frozenset[str],
        key_hash: str,
        prefix: str,
        expires: float | None,
    ) -> ApiKeyRow:
        return ApiKeyRow(
            id=f"key_{uuid.uuid4().hex[:20]}",
            tenant_id=tenant_id,
            name=name,
            prefix=prefix,
            key_hash=key_hash,
            scopes=" ".join(s for s in SCOPES if s in scopes),
            created_at=self._at(self._now()),
            expires_at=self._at(expires) if expires is not None else None,
            rotated_from="",
            requests=0,
            tokens=0,
            documents=0,
        )

    def _audit(
        self, session: object, tenant_id: str, key_id: str, action: str, actor: str, detail: dict[str, object]
    ) -> None:
        session.add(  # type: ignore[attr-defined]
            KeyAuditRow(
                tenant_id=tenant_id,
                key_id=key_id,
                action=action,
                actor=actor,
                detail=json.dumps(detail, sort_keys=True),
                at=self._at(self._now()),
            )
        )

    def _view(self, row: ApiKeyRow) -> KeyView:
        pending = self._pending.get(row.id, [0, 0, 0])
        return KeyView(
            id=row.id,
            name=row.name,
            prefix=row.prefix,
            scopes=row.scopes.split(),
            state=self._state(row),
            created_at=_iso(row.created_at) or "",
            expires_at=_iso(row.expires_at),
            revoked_at=_iso(row.revoked_at),
            last_used_at=_iso(row.last_used_at),
            rotated_from=row.rotated_from,
            usage={
                "requests": row.requests + pending[0],
                "tokens": row.tokens + pending[1],
                "documents": row.documents + pending[2],
            },
        )

    async def create(
        self,
        tenant_name: str,
        name: str,
        scopes: Iterable[str] | None = None,
        expires_in_s: float | None = None,
        *,
        actor: str = "admin",
    ) -> tuple[KeyView, str]:
        """A new key for the tenant; the secret is returned this once."""
        granted = check_scopes(scopes)
        if not name or len(name) > 63 or not name.isprintable():
            raise errors.ValidationError("name", "must be 1 to 63 printable characters")
        if expires_in_s is not None and not 0 < expires_in_s <= MAX_LIFETIME_S:
            raise errors.ValidationError("expires_in_s", f"must be between 0 and {MAX_LIFETIME_S} seconds")
        secret = new_api_key()
        async with self._db.session() as session:
            tenant = await self._tenant_row(session, tenant_name)
            await self._adopt(session, tenant, actor)
            held = await session.scalar(
                sa.select(sa.func.count())
                .select_from(ApiKeyRow)
                .where(ApiKeyRow.tenant_id == tenant.id, ApiKeyRow.revoked_at.is_(None))
            )
            if (held or 0) >= MAX_KEYS_PER_TENANT:
                raise errors.ConflictError(
                    f"tenant {tenant_name!r} has {held} keys, at most {MAX_KEYS_PER_TENANT}"
                )
            expires = self._now() + expires_in_s if expires_in_s is not None else None
            row = self._new_row(
                tenant.id, name, granted, hash_api_key(secret), secret[:PREFIX_CHARS], expires
            )
            session.add(row)
            self._audit(
                session,
                tenant.id,
                row.id,
                "created",
                actor,
                {"name": name, "scopes": sorted(granted), "expires_in_s": expires_in_s},
            )
        return self._view(row), secret

    async def list_keys(self, tenant_name: str, *, actor: str = "admin") -> list[KeyView]:
        await self.flush()
        async with self._db.session() as session:
            tenant = await self._tenant_row(session, tenant_name)
            await self._adopt(session, tenant, actor)
        async with self._db.session() as session:
            rows = (
                await session.scalars(
                    sa.select(ApiKeyRow)
                    .where(ApiKeyRow.tenant_id == tenant.id)
                    .order_by(ApiKeyRow.created_at, ApiKeyRow.id)
                )
            ).all()
        return [self._view(r) for r in rows]

    async def _key_row(self, session: object, tenant: TenantRow, key_id: str) -> ApiKeyRow:
        row = await session.scalar(  # type: ignore[attr-defined]
            sa.select(ApiKeyRow).where(
                ApiKeyRow.tenant_id == tenant.id, sa.or_(ApiKeyRow.id == key_id, ApiKeyRow.name == key_id)
            )
        )
        if row is None:
            raise errors.NotFoundError(f"tenant {tenant.name!r} has no key {key_id!r}")
        return row  # type: ignore[no-any-return]

    async def rotate(
        self, tenant_name: str, key_id: str, overlap_s: float, *, actor: str = "admin"
    ) -> tuple[KeyView, str]:
        """A new key with the same name and scopes; the old one keeps working ``overlap_s`` more
        seconds (or until its own expiry, if sooner), then stops."""
        if not 0 <= overlap_s <= MAX_OVERLAP_S:
            raise errors.ValidationError("overlap_s", f"must be between 0 and {MAX_OVERLAP_S} seconds")
        secret = new_api_key()
        async with self._db.session() as session:
            tenant = await self._tenant_row(session, tenant_name)
            await self._adopt(session, tenant, actor)
            await session.flush()
            old = await self._key_row(session, tenant, key_id)
            if self._state(old) != "active":
                raise errors.ConflictError(f"key {old.id!r} is {self._state(old)}; create a new key instead")
            ends = self._now() + overlap_s
            old_ends = old.expires_at.replace(tzinfo=dt.UTC).timestamp() if old.expires_at else None
            old.expires_at = self._at(min(ends, old_ends) if old_ends is not None else ends)
            row = self._new_row(
                tenant.id,
                old.name,
                frozenset(old.scopes.split()),
                hash_api_key(secret),
                secret[:PREFIX_CHARS],
                old_ends,
            )
            row.rotated_from = old.id
            session.add(row)
            self._audit(
                session, tenant.id, old.id, "rotated", actor, {"new_key": row.id, "overlap_s": overlap_s}
            )
            self._audit(session, tenant.id, row.id, "created", actor, {"rotated_from": old.id})
        self._cached.clear()
        return self._view(row), secret

    async def revoke(self, tenant_name: str, key_id: str, *, actor: str = "admin") -> KeyView:
        """The key stops working now (within ``ttl_s`` on other replicas)."""
        async with self._db.session() as session:
            tenant = await self._tenant_row(session, tenant_name)
            await self._adopt(session, tenant, actor)
            await session.flush()
            row = await self._key_row(session, tenant, key_id)
            if row.revoked_at is None:
                row.revoked_at = self._at(self._now())
                self._audit(session, tenant.id, row.id, "revoked", actor, {})
        self._cached.clear()
        return self._view(row)

    async def usage_of(self, tenant: Tenant) -> list[KeyView]:
        """The tenant's own keys (for ``GET /v1/keys``): what each was used for."""
        await self.flush()
        async with self._db.session() as session:
            rows = (
                await session.scalars(
                    sa.select(ApiKeyRow)
                    .where(ApiKeyRow.tenant_id == tenant.id)
                    .order_by(ApiKeyRow.created_at, ApiKeyRow.id)
                )
            ).all()
        return [self._view(r) for r in rows]

    async def note(
        self, tenant_name: str, action: str, detail: dict[str, object], *, actor: str = "admin"
    ) -> None:
        """Audit a change to the tenant itself (``tenant.created``, ``tenant.training``)."""
        async with self._db.session() as session:
            tenant = await self._tenant_row(session, tenant_name)
            self._audit(session, tenant.id, "", action, actor, detail)

    async def audit(self, tenant_name: str, after: int = 0, limit: int = 100) -> list[dict[str, object]]:
        async with self._db.session() as session:
            tenant = await self._tenant_row(session, tenant_name)
            rows = (
                await session.scalars(
                    sa.select(KeyAuditRow)
                    .where(KeyAuditRow.tenant_id == tenant.id, KeyAuditRow.seq > after)
                    .order_by(KeyAuditRow.seq)
                    .limit(limit)
                )
            ).all()
        return [
            {
                "seq": r.seq,
                "key_id": r.key_id,
                "action": r.action,
                "actor": r.actor,
                "detail": json.loads(r.detail),
                "at": _iso(r.at),
            }
            for r in rows
        ]

    async def run_flush_loop(self, interval_s: float = 5.0) -> None:
        """Background: :meth:`flush` every ``interval_s``."""
        while True:
            await asyncio.sleep(interval_s)
            await self.flush()
