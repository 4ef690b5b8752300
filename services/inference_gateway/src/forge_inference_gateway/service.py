"""Gateway domain logic: tenants and API keys, admission (rate limits), model aliases, routing.

A request goes through these steps, in the routes and the gRPC servicer alike:

1. authenticate the API key to a tenant (keys are stored as SHA-256 hashes only);
2. admit it against the tenant's requests-per-minute bucket (the shared cache: Redis or in-process);
3. resolve its ``model`` through the alias table (``forge-chat`` → the production model);
4. forward it to the model server with what is left of the request's deadline.

Aliases change only through ``ModelPromoted`` events (:meth:`InferenceGateway.apply_model_promoted`,
the consumer's handler) so every gateway replica converges on the registry's decision.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import sqlalchemy as sa
from forge.events.v1 import events_pb2
from google.protobuf.message import Message
from sqlalchemy.ext.asyncio import AsyncSession

from forge_inference_gateway.store import ModelAliasRow, TenantRow, utcnow
from forge_inference_gateway.upstream import ModelServerClient, UpstreamError, error_for
from forge_kit import errors
from forge_kit.cache import Cache
from forge_kit.db import Database

PRIORITY_CLASSES = ("interactive", "batch")
BOOTSTRAP_TENANT = "default"
#: Stage whose model the public alias ``forge-chat`` serves.
PUBLIC_ALIASES = {"production": "forge-chat"}
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


@dataclass(frozen=True)
class Alias:
    alias: str
    model_name: str
    model_version: str
    stage: str
    updated_at: str

    @property
    def target(self) -> str:
        """The model id sent upstream: ``name``, or ``name:version`` when a version is pinned."""
        return f"{self.model_name}:{self.model_version}" if self.model_version else self.model_name


@dataclass(frozen=True)
class StreamChunk:
    """One piece of a generation as the gRPC API reports it; the last has ``finish_reason``."""

    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


def _tenant(row: TenantRow) -> Tenant:
    return Tenant(id=row.id, name=row.name, priority_class=row.priority_class, rpm_limit=row.rpm_limit)


def _alias(row: ModelAliasRow) -> Alias:
    return Alias(row.alias, row.model_name, row.model_version, row.stage, row.updated_at.isoformat() + "Z")


class InferenceGateway:
    """Tenants, admission, aliases and forwarding to one upstream model server."""

    def __init__(
        self,
        db: Database,
        cache: Cache,
        upstream: ModelServerClient,
        *,
        default_rpm_limit: int = 600,
        request_timeout_s: float = 60.0,
        internal_token: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._db = db
        self._cache = cache
        self.upstream = upstream
        self._default_rpm = default_rpm_limit
        self._timeout_s = request_timeout_s
        self._internal_token = internal_token
        self._clock = clock

    # -- tenants -----------------------------------------------------------------------------

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
        return _tenant(row)

    async def create_tenant(
        self, name: str, priority_class: str = "interactive", rpm_limit: int | None = None
    ) -> tuple[Tenant, str]:
        """A new tenant and its API key; the key is shown this once and only its hash is kept."""
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
            )
            session.add(row)
        return _tenant(row), api_key

    async def list_tenants(self) -> list[Tenant]:
        async with self._db.session() as session:
            rows = (await session.scalars(sa.select(TenantRow).order_by(TenantRow.name))).all()
        return [_tenant(r) for r in rows]

    async def tenant_named(self, name: str) -> Tenant:
        async with self._db.session() as session:
            row = await session.scalar(sa.select(TenantRow).where(TenantRow.name == name))
        if row is None:
            raise errors.NotFoundError(f"tenant {name!r} not found")
        return _tenant(row)

    async def authenticate(self, api_key: str) -> Tenant:
        """The tenant of ``api_key``. The service's own token (platform callers) acts as ``default``."""
        if not api_key:
            raise errors.UnauthenticatedError("missing API key: send Authorization: Bearer <key>")
        if self._internal_token and secrets.compare_digest(api_key.encode(), self._internal_token.encode()):
            return await self.tenant_named(BOOTSTRAP_TENANT)
        async with self._db.session() as session:
            row = await session.scalar(
                sa.select(TenantRow).where(TenantRow.key_hash == hash_api_key(api_key))
            )
        if row is None:
            raise errors.UnauthenticatedError("invalid API key")
        return _tenant(row)

    async def admit(self, tenant: Tenant) -> None:
        """Take one request from the tenant's per-minute budget, or refuse with when to retry."""
        allowed, wait_s = await self._cache.allow(
            f"rpm:{tenant.id}", tenant.rpm_limit / 60.0, tenant.rpm_limit
        )
        if not allowed:
            raise errors.OverloadedError(
                f"tenant {tenant.name!r} is over its limit of {tenant.rpm_limit} requests per minute", wait_s
            )

    # -- aliases -----------------------------------------------------------------------------

    async def apply_model_promoted(self, event: Message, session: AsyncSession) -> None:
        """Consumer handler of ``ModelPromoted``: the stage (and its public alias) now names the model.

        Runs inside the consumer's transaction, which also records the event id, so a redelivered
        event is skipped there. An event older than the alias's current state cannot be told apart
        here; the registry publishes in order per stage (keyed by stage).
        """
        assert isinstance(event, events_pb2.ModelPromoted)
        stage = event.stage.strip()
        if not stage or not event.model.name:
            raise errors.ValidationError("stage" if not stage else "model.name", "is required")
        for alias in (stage, PUBLIC_ALIASES.get(stage)):
            if alias is None:
                continue
            row = await session.get(ModelAliasRow, alias)
            if row is None:
                row = ModelAliasRow(alias=alias)
                session.add(row)
            row.model_name = event.model.name
            row.model_version = event.model.version
            row.stage = stage
            row.source_event_id = event.meta.event_id
            row.updated_at = utcnow()

    async def list_aliases(self) -> list[Alias]:
        async with self._db.session() as session:
            rows = (await session.scalars(sa.select(ModelAliasRow).order_by(ModelAliasRow.alias))).all()
        return [_alias(r) for r in rows]

    async def resolve_model(self, model: str) -> tuple[str, Alias | None]:
        """The upstream model id for ``model`` (an alias or a model id) and the alias used, if any."""
        async with self._db.session() as session:
            row = await session.get(ModelAliasRow, model)
        if row is None:
            return model, None
        alias = _alias(row)
        return alias.target, alias

    # -- forwarding --------------------------------------------------------------------------

    def deadline(self, caller_remaining_s: float | None = None) -> float:
        """Absolute monotonic deadline: the gateway's timeout, or the caller's if that is sooner."""
        budget = self._timeout_s if caller_remaining_s is None else min(self._timeout_s, caller_remaining_s)
        return self._clock() + budget

    async def list_models(self, deadline: float) -> list[dict[str, object]]:
        """The upstream's models, then every alias whose target the upstream serves."""
        reply = await self.upstream.request("GET", "/v1/models", deadline)
        if reply.status_code != 200:
            raise error_for(reply.status_code, reply.content, reply.headers.get("retry-after"))
        cards: list[dict[str, object]] = list(reply.json().get("data", []))
        served = {str(c.get("id")): c for c in cards}
        for alias in await self.list_aliases():
            card = served.get(alias.target) or served.get(alias.model_name)
            if card is not None and alias.alias not in served:
                cards.append(
                    {**card, "id": alias.alias, "alias_of": alias.target, "version": alias.model_version}
                )
        return cards

    async def prepare(self, body: object) -> dict[str, object]:
        """Validate the body enough to route it and rewrite ``model`` to the upstream's id."""
        if not isinstance(body, dict):
            raise errors.ValidationError("body", "must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str) or not model.strip():
            raise errors.ValidationError("model", "is required and must be a string")
        target, _ = await self.resolve_model(model)
        return {**body, "model": target}

    async def generate(
        self, body: dict[str, object], *, chat: bool, deadline: float
    ) -> AsyncIterator[StreamChunk]:
        """Stream an OpenAI request from the upstream, as text pieces then one final chunk."""
        path = "/v1/chat/completions" if chat else "/v1/completions"
        request = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with self.upstream.stream(path, request, deadline) as reply:
            if reply.status_code != 200:
                raise error_for(reply.status_code, await reply.aread(), reply.headers.get("retry-after"))
            finish: str | None = None
            usage: dict[str, int] = {}
            done = False
            async for line in reply.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    raise UpstreamError(f"model server failed mid-stream: {event['error'].get('message')}")
                usage = event.get("usage") or usage
                for choice in event.get("choices", []):
                    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if text:
                        yield StreamChunk(text=text)
                    finish = choice.get("finish_reason") or finish
            if not done:
                raise UpstreamError("model server closed the stream before it finished")
            yield StreamChunk(
                finish_reason=finish or "stop",
                prompt_tokens=int(usage.get("prompt_tokens", 0)),
                completion_tokens=int(usage.get("completion_tokens", 0)),
            )
