"""Gateway domain logic: tenants, admission, model aliases with canaries, routing, the response cache.

A request goes through these steps, in the HTTP routes and the gRPC servicer alike:

1. authenticate the API key to a tenant (keys are stored as SHA-256 hashes only);
2. admit it against the tenant's requests-per-minute bucket (the shared cache: Redis or in-process);
3. :meth:`InferenceGateway.route`: resolve ``model`` through the alias table, splitting an alias's
   traffic to its canary by a sticky hash of the user (or session, or the request), and give the
   request its priority level (the tenant's class, lowered by the request's ``priority``);
4. :meth:`InferenceGateway.forward`: answer a deterministic request from the response cache, or
   take a slot on a replica (:mod:`admission`, :mod:`routing`) — queueing in priority order, shed
   with 429 when the model's queue is full — and send it there with what is left of the deadline,
   trying another replica when one cannot be reached or is full.

Aliases change through ``ModelPromoted`` events (:meth:`InferenceGateway.apply_model_promoted`, the
consumer's handler), so every gateway replica converges on the registry's decision, and through the
admin API (canary weight, rollback). :meth:`InferenceGateway.run_control_loop` keeps the replica set,
their scraped load and the autoscaling signal current.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import sqlalchemy as sa
import structlog
from forge.events.v1 import events_pb2
from google.protobuf.message import Message
from prometheus_client import Counter, Histogram
from sqlalchemy.ext.asyncio import AsyncSession

from forge_inference_gateway.admission import LEVELS, Admission, Lease, level_for
from forge_inference_gateway.autoscaling import Autoscaler, Recommendation
from forge_inference_gateway.response_cache import (
    CACHE_HEADER,
    ResponseCache,
    cache_key,
    complete_stream,
    is_deterministic,
)
from forge_inference_gateway.routing import NoReplicaError, Replica, ReplicaPool, normalize_url
from forge_inference_gateway.store import ModelAliasRow, TenantRow, UpstreamReplicaRow, utcnow
from forge_inference_gateway.upstream import (
    StreamReply,
    UpstreamError,
    UpstreamUnavailableError,
    error_for,
    not_served_body,
)
from forge_kit import errors
from forge_kit.cache import Cache
from forge_kit.db import Database
from forge_kit.modelref import ModelRef

log = structlog.get_logger(__name__)

PRIORITY_CLASSES = LEVELS
BOOTSTRAP_TENANT = "default"
#: Stage whose model the public alias ``forge-chat`` serves.
PUBLIC_ALIASES = {"production": "forge-chat"}
#: A promotion to the key stage becomes a weighted canary of the value stage's aliases.
CANARY_OF = {"canary": "production"}
#: Response header naming the model version that served the request (a canary split shows here).
MODEL_HEADER = "x-forge-model"
#: A replica's bearer token: visible ASCII only (it goes into a header), bounded.
_REPLICA_TOKEN = re.compile(r"[\x21-\x7e]{0,512}")
#: Upstream statuses after which another replica is tried: it could not take the request.
_RETRY_STATUSES = (429, 503)
# Upstream headers worth relaying; hop-by-hop and length headers are the server's business.
_RELAYED_HEADERS = ("content-type", "retry-after", "x-request-id")
_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")

UPSTREAM_REQUESTS = Counter(
    "forge_gateway_upstream_requests_total",
    "Requests answered by a model version (split: stable or canary of an alias, or direct)",
    ["model", "split", "status"],
)
TTFT = Histogram(
    "forge_gateway_time_to_first_token_seconds",
    "From sending upstream to the first streamed bytes, per model version",
    ["model", "split"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
)
UPSTREAM_SECONDS = Histogram(
    "forge_gateway_upstream_seconds",
    "From sending upstream to the end of the answer, per model version",
    ["model", "split"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
)


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
    canary_name: str = ""
    canary_version: str = ""
    canary_weight: int = 0

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


@dataclass(frozen=True)
class StreamChunk:
    """One piece of a generation as the gRPC API reports it; the last has ``finish_reason``."""

    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True)
class Routed:
    """A request ready to go upstream (step 3 of the module docstring)."""

    path: str
    body: dict[str, object]
    stream: bool
    model: ModelRef
    """The model version the request goes to (an alias resolved, a canary split decided)."""
    split: str
    level: int
    prefix: list[bytes]
    cache_key: str | None
    alias: str | None = None
    requested: str = ""
    """The ``model`` the caller sent (an alias or a model id): what errors name."""

    @property
    def target(self) -> str:
        """The model id sent upstream: ``name`` or ``name:version``."""
        return str(self.model)


@dataclass
class Forwarded:
    """The upstream's answer: ``content`` whole, or ``chunks`` to stream (which end the request when
    they end or are closed). ``headers`` are what the caller may relay."""

    status: int
    headers: dict[str, str]
    content: bytes = b""
    chunks: AsyncGenerator[bytes, None] | None = field(default=None, repr=False)
    model: ModelRef | None = None
    """The model version that answered (named in ``x-forge-model``)."""


def _tenant(row: TenantRow) -> Tenant:
    return Tenant(id=row.id, name=row.name, priority_class=row.priority_class, rpm_limit=row.rpm_limit)


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
    )


def prompt_text(body: dict[str, object]) -> str:
    """The text whose prefix decides replica affinity: the prompt, or the chat turns in order."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return "".join(f"{m.get('role')}\x1f{m.get('content')}\x1e" for m in messages if isinstance(m, dict))
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt and isinstance(prompt[0], str) else " ".join(map(str, prompt))
    return prompt if isinstance(prompt, str) else ""


def canary_bucket(alias: str, tenant_id: str, sticky: str) -> int:
    """0-99, fixed for a (alias, tenant, user/session/request): the canary takes buckets below its weight."""
    digest = hashlib.sha256(f"{alias}\x00{tenant_id}\x00{sticky}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % 100


K = TypeVar("K")
V = TypeVar("V")


class _ReadThrough(Generic[K, V]):
    """Per-request database reads (keys, aliases), kept for ``ttl_s``.

    A missing entry is loaded once however many requests ask at the same moment (50 streams
    arriving together would otherwise make 50 reads). An expired entry is still answered while one
    background read refreshes it, so no request waits on the database once a key is known; a change
    made in this process (``clear``) applies at once, one made elsewhere within ``ttl_s`` and a read.
    """

    def __init__(self, ttl_s: float, clock: Callable[[], float]) -> None:
        self._ttl_s = ttl_s
        self._clock = clock
        self._items: dict[K, tuple[float, V]] = {}
        self._loading: dict[K, asyncio.Future[V]] = {}
        self._refreshing: set[asyncio.Task[None]] = set()
        self._generation = 0

    async def get(self, key: K, load: Callable[[], Awaitable[V]]) -> V:
        item = self._items.get(key)
        if item is not None:
            if item[0] < self._clock() and key not in self._loading:
                task = asyncio.get_running_loop().create_task(self._refresh(key, load))
                self._refreshing.add(task)
                task.add_done_callback(self._refreshing.discard)
            return item[1]
        pending = self._loading.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        return await self._load(key, load)

    async def _load(self, key: K, load: Callable[[], Awaitable[V]]) -> V:
        future: asyncio.Future[V] = asyncio.get_running_loop().create_future()
        self._loading[key] = future
        generation = self._generation
        try:
            value = await load()
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: waiters re-raise it, nobody else needs to
            raise
        else:
            future.set_result(value)
            # A change made while this read ran (``clear``) must not be overwritten by its result.
            if self._ttl_s > 0 and generation == self._generation:
                if len(self._items) > 10_000:
                    self._items.clear()
                self._items[key] = (self._clock() + self._ttl_s, value)
            return value
        finally:
            if self._loading.get(key) is future:
                del self._loading[key]

    async def _refresh(self, key: K, load: Callable[[], Awaitable[V]]) -> None:
        try:
            await self._load(key, load)
        except Exception as exc:  # noqa: BLE001 - gone (a key revoked) or failing: read again next time
            self._items.pop(key, None)
            log.info("read_through.refresh_failed", error=repr(exc))

    def clear(self) -> None:
        self._items.clear()
        self._loading.clear()
        self._generation += 1


#: What a tenant sees of a replica's model card; ``root`` is replaced by the model id.
PUBLIC_CARD_FIELDS = ("id", "object", "created", "owned_by", "max_model_len", "version", "loaded")


def public_card(model_id: str, card: dict[str, object]) -> dict[str, object]:
    """A replica's ``/v1/models`` card without what only the host should know (paths)."""
    public = {key: card[key] for key in PUBLIC_CARD_FIELDS if key in card}
    return {**public, "id": model_id, "root": model_id, "parent": None}


class InferenceGateway:
    """Tenants, admission, aliases and forwarding to a pool of model-server replicas."""

    def __init__(
        self,
        db: Database,
        cache: Cache,
        pool: ReplicaPool,
        *,
        admission: Admission | None = None,
        autoscaler: Autoscaler | None = None,
        responses: ResponseCache | None = None,
        upstream_priority: bool = True,
        upstream_attempts: int = 2,
        default_rpm_limit: int = 600,
        request_timeout_s: float = 60.0,
        internal_token: str | None = None,
        alias_ttl_s: float = 1.0,
        tenant_ttl_s: float = 5.0,
        metrics_interval_s: float = 0.5,
        replica_sync_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._db = db
        self._cache = cache
        self.pool = pool
        self.admission = admission or Admission(pool, clock=clock)
        self.autoscaler = autoscaler or Autoscaler(self.admission, clock=clock)
        self.responses = responses
        self._upstream_priority = upstream_priority
        self._attempts = upstream_attempts
        self._default_rpm = default_rpm_limit
        self._timeout_s = request_timeout_s
        self._internal_token = internal_token
        self._clock = clock
        self._aliases: _ReadThrough[str, Alias | None] = _ReadThrough(alias_ttl_s, clock)
        self._tenants: _ReadThrough[str, Tenant] = _ReadThrough(tenant_ttl_s, clock)
        self._interval_s = metrics_interval_s
        self._sync_s = replica_sync_s
        self._stopping = asyncio.Event()

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
        self._tenants.clear()
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
        async def load() -> Tenant:
            async with self._db.session() as session:
                row = await session.scalar(sa.select(TenantRow).where(TenantRow.name == name))
            if row is None:
                raise errors.NotFoundError(f"tenant {name!r} not found")
            return _tenant(row)

        return await self._tenants.get(f"name:{name}", load)

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

        return await self._tenants.get(key_hash, load)

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

        A promotion to ``canary`` also makes the model the canary of the ``production`` aliases with
        the event's ``traffic_percent`` (0, or a rollback, stops the split). A promotion to
        ``production`` of the canary's own model, or a rollback, ends the split (weight 0).

        Runs inside the consumer's transaction, which also records the event id, so a redelivered
        event is skipped there. An event older than the alias's current state cannot be told apart
        here; the registry publishes in order per stage (keyed by stage).
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
        for alias in (stage, PUBLIC_ALIASES.get(stage)):
            if alias is None:
                continue
            row = await session.get(ModelAliasRow, alias)
            if row is None:
                row = ModelAliasRow(
                    alias=alias, canary_model_name="", canary_model_version="", canary_weight=0
                )
                session.add(row)
            row.model_name = name
            row.model_version = version
            row.stage = stage
            row.source_event_id = event.meta.event_id
            row.updated_at = utcnow()
            if event.is_rollback or (row.canary_model_name, row.canary_model_version) == (name, version):
                row.canary_weight = 0
        base = CANARY_OF.get(stage)
        if base is not None:
            weight = 0 if event.is_rollback else min(100, event.traffic_percent)
            for alias in (base, PUBLIC_ALIASES.get(base)):
                row = await session.get(ModelAliasRow, alias) if alias else None
                if row is None:
                    continue  # nothing stable to split yet
                row.canary_model_name, row.canary_model_version = name, version
                row.canary_weight = weight
                row.updated_at = utcnow()
        self._aliases.clear()

    async def list_aliases(self) -> list[Alias]:
        async with self._db.session() as session:
            rows = (await session.scalars(sa.select(ModelAliasRow).order_by(ModelAliasRow.alias))).all()
        return [_alias(r) for r in rows]

    async def alias_named(self, alias: str) -> Alias | None:
        async def load() -> Alias | None:
            async with self._db.session() as session:
                row = await session.get(ModelAliasRow, alias)
            return _alias(row) if row is not None else None

        return await self._aliases.get(alias, load)

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
        async with self._db.session() as session:
            row = await session.get(ModelAliasRow, alias)
            if row is None:
                raise errors.NotFoundError(f"alias {alias!r} not found")
            row.canary_model_name, row.canary_model_version, row.canary_weight = name, version, weight
            row.updated_at = utcnow()
            result = _alias(row)
        self._aliases.clear()
        return result

    async def rollback_canary(self, alias: str) -> Alias:
        """Admin: all of ``alias``'s traffic back to its stable model at once (canary weight 0)."""
        async with self._db.session() as session:
            row = await session.get(ModelAliasRow, alias)
            if row is None:
                raise errors.NotFoundError(f"alias {alias!r} not found")
            row.canary_weight = 0
            row.updated_at = utcnow()
            result = _alias(row)
        self._aliases.clear()
        return result

    # -- replicas ----------------------------------------------------------------------------

    async def add_replica(self, url: str, token: str = "") -> Replica:
        """Admin: route to one more model-server replica, on every gateway replica (via the store).
        ``token`` is the credential issued for that replica (empty: none): it is what the gateway
        sends there, never its own model-server token."""
        url = normalize_url(url)
        if not _REPLICA_TOKEN.fullmatch(token):
            raise errors.ValidationError("token", "must be at most 512 visible ASCII characters")
        # A configured replica (MODEL_SERVER_URL) is checked first: it must not get a store row,
        # or every gateway would keep routing to it after the setting drops it.
        if self.pool.has(url):
            raise errors.AlreadyExistsError(f"replica {url} is already in the pool")
        async with self._db.session() as session:
            if await session.get(UpstreamReplicaRow, url) is not None:
                raise errors.AlreadyExistsError(f"replica {url} is already in the pool")
            session.add(UpstreamReplicaRow(url=url, token=token))
        return self.pool.add(url, source="admin", token=token)

    async def remove_replica(self, url: str) -> None:
        """Admin: stop routing to a replica added through the admin API; its requests finish there."""
        replica = self.pool.get(url)
        if replica.source != "admin":
            raise errors.ConflictError(
                f"replica {replica.url} is configured (MODEL_SERVER_URL); change the setting"
            )
        async with self._db.session() as session:
            row = await session.get(UpstreamReplicaRow, replica.url)
            if row is not None:
                await session.delete(row)
        await self.pool.remove(replica.url)

    async def sync_replicas(self) -> None:
        """Make the pool's admin-added replicas those in the store (other gateways may have changed it)."""
        async with self._db.session() as session:
            rows = (await session.execute(sa.select(UpstreamReplicaRow.url, UpstreamReplicaRow.token))).all()
        await self.pool.sync({url: token for url, token in rows})

    def autoscaling(self) -> list[Recommendation]:
        return self.autoscaler.publish()

    async def run_control_loop(self) -> None:
        """Until :meth:`stop`, every ``metrics_interval_s``:

        1. re-read the admin-added replicas from the store (every ``replica_sync_s``);
        2. scrape every due replica's ``/metrics`` (and now and then ``/v1/models``); the pool
           then wakes the admission queues, since capacity may have appeared;
        3. publish the autoscaling signal.
        """
        last_sync = float("-inf")
        while not self._stopping.is_set():
            try:
                # 1. Membership.
                if self._clock() - last_sync >= self._sync_s:
                    await self.sync_replicas()
                    last_sync = self._clock()
                # 2. Load and health.
                await self.pool.refresh()
                # 3. Autoscaling signal.
                self.autoscaler.publish()
            except Exception as exc:  # noqa: BLE001 - one bad round must not stop routing
                log.warning("control_loop.round_failed", error=repr(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self._interval_s)

    async def stop(self) -> None:
        self._stopping.set()
        await self.pool.close()

    # -- requests ----------------------------------------------------------------------------

    def deadline(self, caller_remaining_s: float | None = None) -> float:
        """Absolute monotonic deadline: the gateway's timeout, or the caller's if that is sooner."""
        budget = self._timeout_s if caller_remaining_s is None else min(self._timeout_s, caller_remaining_s)
        return self._clock() + budget

    async def list_models(self) -> list[dict[str, object]]:
        """The models the healthy replicas serve, then every alias whose target one of them serves;
        each card only with the fields in :data:`PUBLIC_CARD_FIELDS` (a replica's ``root`` is its
        checkpoint's host path: tenants see the model id there)."""
        await self.pool.ensure_known()
        replicas = self.pool.replicas()
        cards: dict[str, dict[str, object]] = {}
        ready: dict[str, int] = {}
        for replica in replicas:
            if not replica.healthy or replica.cards is None:
                continue
            for model_id, card in replica.cards.items():
                cards.setdefault(model_id, public_card(model_id, card))
                ready[model_id] = ready.get(model_id, 0) + 1
        if not cards:
            for replica in replicas:
                error = replica.models_error or replica.last_error
                if error is not None:
                    raise error
            if not any(r.healthy for r in replicas):
                raise NoReplicaError("no healthy model-server replica", self.pool.retry_after_s())
        served = {model_id: {**card, "ready_replicas": ready[model_id]} for model_id, card in cards.items()}
        listed = list(served.values())
        for alias in await self.list_aliases():
            found = served.get(alias.model_name)
            if found is None or alias.alias in served:
                continue
            version = str(found.get("version") or "")
            if alias.model.pinned and version and version != alias.model_version:
                continue  # the replicas serve another version of the name: the alias cannot answer
            entry: dict[str, object] = {
                **found,
                "id": alias.alias,
                "alias_of": alias.target,
                "version": alias.model_version or version,
            }
            if alias.canary_target and alias.canary_weight:
                entry["canary"] = {"model": alias.canary_target, "weight": alias.canary_weight}
            listed.append(entry)
        return listed

    async def count_tokens(self, target: str, messages: list[dict[str, str]], deadline: float) -> int | None:
        """Prompt tokens of chat ``messages`` for the model ``target``, counted by a replica that
        serves it with its own tokenizer and chat template (vLLM's ``POST /tokenize``); None when
        no healthy replica answers the route (the caller then estimates)."""
        body = {"model": target, "messages": messages}
        for replica in self.pool.candidates(target):
            try:
                reply = await replica.client.request("POST", "/tokenize", deadline, body)
            except UpstreamUnavailableError as exc:
                self.pool.report_failure(replica, exc)
                continue
            count = _tokenize_count(reply.content) if reply.status_code == 200 else None
            if count is not None:
                return count
            log.info("gateway.tokenize_unanswered", replica=replica.url, status=reply.status_code)
        return None

    async def route(self, tenant: Tenant, path: str, body: object, session_key: str | None = None) -> Routed:
        """Step 3: validate what routing needs, resolve the alias (and its canary), set the priority."""
        if not isinstance(body, dict):
            raise errors.ValidationError("body", "must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str) or not model.strip():
            raise errors.ValidationError("model", "is required and must be a string")
        requested = body.get("priority")
        if requested is not None and (isinstance(requested, bool) or not isinstance(requested, int)):
            raise errors.ValidationError("priority", "must be an integer (lower runs first)")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise errors.ValidationError("stream", "must be a boolean")
        target, alias = await self.resolve_model(model)
        split = "direct"
        if alias is not None:
            split = "stable"
            canary = alias.canary
            if canary is not None and alias.canary_weight > 0:
                user = body.get("user")
                sticky = (
                    user
                    if isinstance(user, str) and user
                    else session_key or json.dumps(body, sort_keys=True, default=str)
                )
                if canary_bucket(alias.alias, tenant.id, sticky) < alias.canary_weight:
                    target, split = canary, "canary"
        level = level_for(tenant.priority_class, requested)
        upstream: dict[str, object] = {**body, "model": str(target)}
        upstream.pop("priority", None)
        key = None
        if self.responses is not None and is_deterministic(body):
            key = cache_key(tenant.id, path, upstream)
        if self._upstream_priority:
            upstream["priority"] = level
        prefix = self.pool.prefixes.keys(prompt_text(body)) if self.pool.policy.max_blocks else []
        return Routed(
            path=path,
            body=upstream,
            stream=stream,
            model=target,
            split=split,
            level=level,
            prefix=prefix,
            cache_key=key,
            alias=alias.alias if alias else None,
            requested=model,
        )

    async def forward(self, routed: Routed, deadline: float) -> Forwarded:
        """Step 4: the cached answer, or the upstream's through a replica slot.

        1. a deterministic request found in the response cache is answered from it;
        2. take a slot (may queue, may be shed with 429, may time out);
        3. send; a replica that cannot be reached, or answers 429/503, gives its slot back and
           another is tried, ``upstream_attempts`` in all;
        4. a whole answer releases the slot at once; a stream keeps it until it ends.
        """
        gateway_headers: dict[str, str] = {}
        # 1. Cache.
        if routed.cache_key is not None and self.responses is not None:
            hit = await self.responses.get(routed.cache_key)
            if hit is not None:
                headers = {
                    MODEL_HEADER: str(routed.model),
                    "content-type": hit.content_type,
                    CACHE_HEADER: "hit",
                }
                UPSTREAM_REQUESTS.labels(routed.target, routed.split, "cached").inc()
                if routed.stream:
                    return Forwarded(200, headers, chunks=_once(hit.content), model=routed.model)
                return Forwarded(200, headers, content=hit.content, model=routed.model)
            gateway_headers[CACHE_HEADER] = "miss"
        exclude: frozenset[str] = frozenset()
        last_error: errors.ForgeError | None = None
        for attempt in range(self._attempts):
            # 2. A slot.
            try:
                lease = await self.admission.acquire(
                    routed.target, routed.level, routed.prefix, deadline, exclude
                )
            except NoReplicaError:
                if last_error is None:
                    raise
                raise last_error from None
            replica = lease.replica
            started = self._clock()
            # 3. Send.
            stream: StreamReply | None = None
            try:
                if routed.stream:
                    stream = await replica.client.open_stream(routed.path, routed.body, deadline)
                    status, upstream_headers = stream.status_code, stream.headers
                    content = b""
                    if status != 200:
                        try:
                            content = await stream.aread()
                        finally:
                            await stream.aclose()
                else:
                    reply = await replica.client.request("POST", routed.path, deadline, routed.body)
                    status, upstream_headers, content = reply.status_code, reply.headers, reply.content
            except UpstreamUnavailableError as exc:
                lease.release()
                self.pool.report_failure(replica, exc)
                exclude, last_error = exclude | {replica.url}, exc
                continue
            except BaseException:
                lease.release()
                raise
            self.pool.report_success(replica)
            served = replica.answering(routed.model)
            headers = (
                {k: v for k, v in upstream_headers.items() if k in _RELAYED_HEADERS}
                | gateway_headers
                | {MODEL_HEADER: str(served)}
            )
            if stream is not None and status == 200:
                # 4. A stream holds its slot until it ends.
                chunks = self._stream(routed, stream, lease, started)
                return Forwarded(200, headers, chunks=chunks, model=served)
            lease.release()
            self._observe_end(routed, status, started)
            retry = status in _RETRY_STATUSES and attempt + 1 < self._attempts
            if retry and self.pool.candidates(routed.target, exclude | {replica.url}):
                exclude = exclude | {replica.url}
                last_error = UpstreamUnavailableError(f"replica {replica.url} is full")
                continue
            if status == 200 and routed.cache_key and self.responses is not None:
                await self.responses.put(routed.cache_key, headers.get("content-type", ""), content)
            if status == 404 and routed.alias is not None and replica.serves(routed.target) is not True:
                # The alias names a version this replica does not list: say so of what was asked
                # (a model it lists but cannot load keeps the replica's own reason).
                content, headers["content-type"] = not_served_body(routed.requested), "application/json"
            return Forwarded(status, headers, content=content, model=served)
        assert last_error is not None
        raise last_error

    async def _stream(
        self, routed: Routed, response: StreamReply, lease: Lease, started: float
    ) -> AsyncGenerator[bytes, None]:
        """Relay a stream's bytes; measure its first token; keep it for the cache if it completes."""
        keep = bytearray() if routed.cache_key and self.responses is not None else None
        first = True
        completed = False
        try:
            async for chunk in response.aiter_bytes():
                if first:
                    first = False
                    ttft = self._clock() - started
                    TTFT.labels(routed.target, routed.split).observe(ttft)
                    self.autoscaler.observe(routed.target, ttft)
                if keep is not None:
                    keep.extend(chunk)
                    if self.responses is not None and len(keep) > self.responses.max_bytes:
                        keep = None  # too large to cache: stop holding it
                yield chunk
            completed = True
        finally:
            await response.aclose()
            lease.release()
            self._observe_end(routed, 200 if completed else 499, started)
        if keep is not None and self.responses is not None and complete_stream(bytes(keep)):
            await self.responses.put(routed.cache_key or "", "text/event-stream", bytes(keep))

    def _observe_end(self, routed: Routed, status: int, started: float) -> None:
        UPSTREAM_REQUESTS.labels(routed.target, routed.split, str(status)).inc()
        UPSTREAM_SECONDS.labels(routed.target, routed.split).observe(self._clock() - started)

    async def generate(
        self, tenant: Tenant, body: dict[str, object], *, chat: bool, deadline: float
    ) -> AsyncIterator[tuple[ModelRef, StreamChunk]]:
        """Stream an OpenAI request as text pieces then one final chunk (the gRPC API's view), each
        with the model version that answers it."""
        path = "/v1/chat/completions" if chat else "/v1/completions"
        request = {**body, "stream": True, "stream_options": {"include_usage": True}}
        routed = await self.route(tenant, path, request)
        forwarded = await self.forward(routed, deadline)
        if forwarded.chunks is None:
            raise error_for(forwarded.status, forwarded.content, forwarded.headers.get("retry-after"))
        served = forwarded.model or routed.model
        finish: str | None = None
        usage: dict[str, int] = {}
        done = False
        try:
            async for line in _lines(forwarded.chunks):
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if done or data == "[DONE]":
                    done = True  # read on to the end, so the stream counts as complete
                    continue
                event = json.loads(data)
                if "error" in event:
                    raise UpstreamError(f"model server failed mid-stream: {event['error'].get('message')}")
                usage = event.get("usage") or usage
                for choice in event.get("choices", []):
                    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if text:
                        yield served, StreamChunk(text=text)
                    finish = choice.get("finish_reason") or finish
        finally:
            await forwarded.chunks.aclose()
        if not done:
            raise UpstreamError("model server closed the stream before it finished")
        yield (
            served,
            StreamChunk(
                finish_reason=finish or "stop",
                prompt_tokens=int(usage.get("prompt_tokens", 0)),
                completion_tokens=int(usage.get("completion_tokens", 0)),
            ),
        )


def _tokenize_count(content: bytes) -> int | None:
    """``count`` of a ``/tokenize`` answer, or None when the body is not one."""
    try:
        count = json.loads(content).get("count")
    except (ValueError, AttributeError):
        return None
    return count if isinstance(count, int) and not isinstance(count, bool) and count >= 0 else None


async def _once(content: bytes) -> AsyncGenerator[bytes, None]:
    yield content


async def _lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """Text lines of a byte stream, split however its chunks fall."""
    pending = b""
    async for chunk in chunks:
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.decode().rstrip("\r")
    if pending:
        yield pending.decode()
