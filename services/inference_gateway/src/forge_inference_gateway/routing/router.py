"""The request path: steps 3 and 4 of a request, after the tenant is known and admitted.

3. :meth:`Router.route`: resolve ``model`` through the alias table (an alias's previous model
   while no replica serves its new one yet), splitting an alias's traffic to its canary by a sticky hash of the user (or session, or the request), and give the request
   its priority level (the tenant's class, lowered by the request's ``priority``);
4. :meth:`Router.forward`: answer a deterministic request from the response cache, or take a slot
   on a replica (:mod:`.admission`; :mod:`~forge_inference_gateway.replicas.pool` picks the replica) — queueing in priority order,
   shed with 429 when the model's queue is full — and send it there with what is left of the
   deadline, trying another replica when one cannot be reached or is full.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field

from prometheus_client import Counter, Histogram

from forge_inference_gateway.caching.response_cache import (
    CACHE_HEADER,
    ResponseCache,
    cache_key,
    complete_stream,
    is_deterministic,
)
from forge_inference_gateway.replicas.autoscaling import Autoscaler
from forge_inference_gateway.replicas.metering import TAIL_BYTES, meter
from forge_inference_gateway.replicas.pool import NoReplicaError, ReplicaPool
from forge_inference_gateway.replicas.upstream import (
    StreamBroken,
    StreamReply,
    UpstreamUnavailableError,
    not_served_body,
)
from forge_inference_gateway.replicas.upstream_errors import conform_error
from forge_inference_gateway.routing.admission import Admission, Lease, level_for
from forge_inference_gateway.routing.aliases import Alias, Aliases, canary_bucket
from forge_inference_gateway.tenants.registry import Tenant
from forge_kit import errors
from forge_kit.latency import LATENCY_BUCKETS
from forge_kit.modelref import ModelRef

#: Response header naming the model version that served the request (a canary split shows here).
MODEL_HEADER = "x-forge-model"
#: Upstream statuses after which another replica is tried: it could not take the request.
_RETRY_STATUSES = (429, 503)
# Upstream headers worth relaying; hop-by-hop and length headers are the server's business.
_RELAYED_HEADERS = ("content-type", "retry-after", "x-request-id")

UPSTREAM_REQUESTS = Counter(
    "forge_gateway_upstream_requests_total",
    "Requests answered by a model version (split: stable or canary of an alias, or direct); status "
    "is the upstream's HTTP status, ``cached``, ``timeout`` (deadline passed), ``unavailable`` (no "
    "replica could take it) or ``broken`` (a stream cut mid-answer)",
    ["model", "split", "status"],
)

TTFT = Histogram(
    "forge_gateway_time_to_first_token_seconds",
    "From sending upstream to the first streamed bytes, per model version",
    ["model", "split"],
    buckets=LATENCY_BUCKETS,
)

ITL = Histogram(
    "forge_gateway_inter_token_latency_seconds",
    "Mean gap between a stream's chunks after the first, one observation per stream",
    ["model", "split"],
    buckets=LATENCY_BUCKETS,
)

UPSTREAM_SECONDS = Histogram(
    "forge_gateway_upstream_seconds",
    "From sending upstream to the end of the answer, per model version",
    ["model", "split"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
)

EMPTY_ANSWERS = Counter(
    "forge_gateway_empty_answers_total",
    "Successful answers with no generated text (the canary analysis's online quality proxy)",
    ["model", "split"],
)

#: Generated text in a completion or chat answer (or stream chunk): a non-empty ``text``/``content``.
_GENERATED = re.compile(rb'"(?:text|content)"\s*:\s*"[^"]')


@dataclass(frozen=True)
class GenerationRequest:
    """A completion or chat completion body with what routing reads checked once, at the edge
    (:meth:`parse`); ``body`` goes upstream as sent, its ``model`` resolved."""

    body: dict[str, object]
    model: str
    """The ``model`` asked for: an alias or a model reference (``name`` or ``name:version``)."""
    stream: bool = False
    priority: int | None = None
    """The body's ``priority`` (vLLM's meaning: lower runs first); it can only lower the tenant's."""
    user: str | None = None
    """The body's ``user`` when it is a non-empty string: what keeps a canary split sticky."""

    @classmethod
    def parse(cls, raw: object) -> GenerationRequest:
        """The request, or a ``ValidationError`` naming the first field routing cannot use."""
        if not isinstance(raw, dict):
            raise errors.ValidationError("body", "must be a JSON object")
        model = raw.get("model")
        if not isinstance(model, str) or not model.strip():
            raise errors.ValidationError("model", "is required and must be a string")
        priority = raw.get("priority")
        if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
            raise errors.ValidationError("priority", "must be an integer (lower runs first)")
        stream = raw.get("stream", False)
        if not isinstance(stream, bool):
            raise errors.ValidationError("stream", "must be a boolean")
        user = raw.get("user")
        return cls(raw, model, stream, priority, user if isinstance(user, str) and user else None)


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
    shadow: ModelRef | None = None
    """The alias's shadow model when this request is also mirrored there (:mod:`.shadow`)."""

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


def prompt_text(body: dict[str, object]) -> str:
    """The text whose prefix decides replica affinity: the prompt, or the chat turns in order."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return "".join(f"{m.get('role')}\x1f{m.get('content')}\x1e" for m in messages if isinstance(m, dict))
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt and isinstance(prompt[0], str) else " ".join(map(str, prompt))
    return prompt if isinstance(prompt, str) else ""


class Router:
    """Routes a tenant's request to a model version and forwards it to a replica slot."""

    def __init__(
        self,
        pool: ReplicaPool,
        aliases: Aliases,
        admission: Admission,
        autoscaler: Autoscaler,
        *,
        responses: ResponseCache | None = None,
        upstream_priority: bool = True,
        upstream_attempts: int = 2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self._aliases = aliases
        self.admission = admission
        self.autoscaler = autoscaler
        self.responses = responses
        self._upstream_priority = upstream_priority
        self._attempts = upstream_attempts
        self._clock = clock

    async def resolve(self, model: str) -> tuple[ModelRef, Alias | None]:
        """The model version ``model`` sends its stable traffic to, and its alias: an alias's
        model, or the one it named before while no replica serves the new one yet
        (:meth:`ReplicaPool.serving`); a model reference itself."""
        target, alias = await self._aliases.resolve_model(model)
        if alias is not None:
            target = self.pool.serving(alias.model, alias.previous)
        return target, alias

    async def route(
        self, tenant: Tenant, path: str, request: GenerationRequest, session_key: str | None = None
    ) -> Routed:
        """Step 3: resolve the alias (its new version once a replica serves it; its canary), set
        the priority."""
        body = request.body
        target, alias = await self.resolve(request.model)
        split = "direct"
        shadow = None
        if alias is not None:
            split = "stable"
            canary = alias.canary
            sticky = request.user or session_key or json.dumps(body, sort_keys=True, default=str)
            if canary is not None and canary_bucket(alias.alias, tenant.id, sticky) < alias.canary_weight:
                target, split = canary, "canary"
            mirrored = canary_bucket(f"{alias.alias}\x00shadow", tenant.id, sticky) < alias.shadow_percent
            if split == "stable" and not request.stream and mirrored:
                shadow = alias.shadow
        level = level_for(tenant.priority_class, request.priority)
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
            stream=request.stream,
            model=target,
            split=split,
            level=level,
            prefix=prefix,
            cache_key=key,
            alias=alias.alias if alias else None,
            requested=request.model,
            shadow=shadow,
        )

    async def forward(self, routed: Routed, deadline: float) -> Forwarded:
        """Step 4 (:meth:`_forward`), with a request that gets no answer counted against its model
        version and split: ``timeout`` past the deadline, ``unavailable`` when no replica could
        take it (a crashed canary replica shows here, not as missing traffic)."""
        try:
            return await self._forward(routed, deadline)
        except TimeoutError:
            UPSTREAM_REQUESTS.labels(routed.target, routed.split, "timeout").inc()
            raise
        except UpstreamUnavailableError:
            UPSTREAM_REQUESTS.labels(routed.target, routed.split, "unavailable").inc()
            raise

    async def _forward(self, routed: Routed, deadline: float) -> Forwarded:
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
                    routed.model, routed.level, routed.prefix, deadline, exclude
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
                chunks = self._stream(routed, stream, lease, started, deadline)
                return Forwarded(200, headers, chunks=chunks, model=served)
            lease.release()
            # An alias's version that no replica lists (its replicas crashed) is the version's
            # failure, not the caller's mistake.
            missing = status == 404 and routed.alias is not None and replica.serves(routed.model) is not True
            self._observe_end(routed, "unavailable" if missing else status, started)
            if status == 200 and not _GENERATED.search(content):
                EMPTY_ANSWERS.labels(routed.target, routed.split).inc()
            if status == 200:
                meter(str(served), content)
            retry = status in _RETRY_STATUSES and attempt + 1 < self._attempts
            if retry and self.pool.candidates(routed.model, exclude | {replica.url}):
                exclude = exclude | {replica.url}
                last_error = UpstreamUnavailableError(f"replica {replica.url} is full")
                continue
            if status == 200 and routed.cache_key and self.responses is not None:
                await self.responses.put(routed.cache_key, headers.get("content-type", ""), content)
            if missing:
                # The alias names a version this replica does not list: say so of what was asked
                # (a model it lists but cannot load keeps the replica's own reason).
                content, headers["content-type"] = not_served_body(routed.requested), "application/json"
            elif 400 <= status < 500:
                # Whichever engine refused, the caller sees one shape (replicas.upstream_errors).
                content, headers["content-type"] = (
                    conform_error(status, content, routed.body),
                    "application/json",
                )
            return Forwarded(status, headers, content=content, model=served)
        assert last_error is not None
        raise last_error

    async def _stream(
        self, routed: Routed, response: StreamReply, lease: Lease, started: float, deadline: float
    ) -> AsyncGenerator[bytes, None]:
        """Relay a stream's bytes; measure its first token and the gaps between its events; keep
        it for the cache if it completes. A stream that ends early is ``broken`` when the model
        server cut it, ``timeout`` past the deadline, else 499 (the client went away)."""
        keep = bytearray() if routed.cache_key and self.responses is not None else None
        tail = b""
        first_at: float | None = None
        events = 0
        generated = False
        status = "499"
        try:
            async for chunk in response.aiter_bytes():
                if first_at is None:
                    first_at = self._clock()
                    ttft = first_at - started
                    TTFT.labels(routed.target, routed.split).observe(ttft)
                    self.autoscaler.observe(routed.model, ttft)
                events += chunk.count(b"data:")
                generated = generated or _GENERATED.search(chunk) is not None
                tail = (tail + chunk)[-TAIL_BYTES:]
                if keep is not None:
                    keep.extend(chunk)
                    if self.responses is not None and len(keep) > self.responses.max_bytes:
                        keep = None  # too large to cache: stop holding it
                yield chunk
            status = "200"
        except StreamBroken:
            status = "broken"
            raise
        finally:
            await response.aclose()
            lease.release()
            if status == "499" and self._clock() >= deadline:
                status = "timeout"
            self._observe_end(routed, status, started)
            if status == "200":
                if first_at is not None and events > 2:  # the last event is [DONE]
                    ITL.labels(routed.target, routed.split).observe((self._clock() - first_at) / (events - 2))
                if not generated:
                    EMPTY_ANSWERS.labels(routed.target, routed.split).inc()
                meter(str(routed.model), tail)
        if keep is not None and self.responses is not None and complete_stream(bytes(keep)):
            await self.responses.put(routed.cache_key or "", "text/event-stream", bytes(keep))

    def _observe_end(self, routed: Routed, status: int | str, started: float) -> None:
        UPSTREAM_REQUESTS.labels(routed.target, routed.split, str(status)).inc()
        UPSTREAM_SECONDS.labels(routed.target, routed.split).observe(self._clock() - started)


async def _once(content: bytes) -> AsyncGenerator[bytes, None]:
    yield content
