"""The gateway: its parts wired together, and the request path as the APIs call it.

A request goes through these steps, in the HTTP routes and the gRPC servicer alike:

1. authenticate the API key to a tenant (:meth:`Tenants.authenticate <tenants.Tenants.authenticate>`;
   keys are stored as SHA-256 hashes only);
2. admit it against the tenant's requests-per-minute bucket (:meth:`Tenants.admit
   <tenants.Tenants.admit>`; the shared cache: Redis or in-process);
3. :meth:`Router.route <router.Router.route>`: resolve ``model`` through the alias table
   (:mod:`routing.aliases`), splitting an alias's traffic to its canary, and give the request its priority
   level;
4. :meth:`Router.forward <router.Router.forward>`: answer from the response cache, or take a slot on
   a replica (:mod:`routing.admission`, :mod:`replicas.pool`) and send it there with what is left of the deadline.

:class:`InferenceGateway` builds the parts — :attr:`~InferenceGateway.tenants`,
:attr:`~InferenceGateway.aliases`, :attr:`~InferenceGateway.replicas` (membership and the control
loop), :attr:`~InferenceGateway.router` — and answers what spans them: the deadline, the model
list (replicas and aliases), token counts, and a generation as the gRPC API streams it.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from urllib.parse import urlencode

import structlog

from forge_inference_gateway.caching.response_cache import ResponseCache
from forge_inference_gateway.keys.service import ApiKeys
from forge_inference_gateway.replicas.autoscaling import Autoscaler
from forge_inference_gateway.replicas.membership import Replicas
from forge_inference_gateway.replicas.pool import NoReplicaError, ReplicaPool
from forge_inference_gateway.replicas.upstream import (
    Reply,
    UpstreamError,
    UpstreamUnavailableError,
    error_for,
)
from forge_inference_gateway.routing.admission import Admission
from forge_inference_gateway.routing.aliases import Aliases
from forge_inference_gateway.routing.router import GenerationRequest, Router
from forge_inference_gateway.routing.shadow import Shadows
from forge_inference_gateway.tenants.registry import Tenant, Tenants
from forge_inference_gateway.tenants.training_prompts import TrainingPrompts
from forge_kit.cache import Cache
from forge_kit.db import Database
from forge_kit.modelref import ModelRef

log = structlog.get_logger(__name__)

#: What a tenant sees of a replica's model card; ``root`` is replaced by the model id.
PUBLIC_CARD_FIELDS = ("id", "object", "created", "owned_by", "max_model_len", "version", "loaded")


@dataclass(frozen=True)
class StreamChunk:
    """One piece of a generation as the gRPC API reports it; the last has ``finish_reason``."""

    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


def public_card(model_id: str, card: dict[str, object]) -> dict[str, object]:
    """A replica's ``/v1/models`` card without what only the host should know (paths)."""
    public = {key: card[key] for key in PUBLIC_CARD_FIELDS if key in card}
    return {**public, "id": model_id, "root": model_id, "parent": None}


class InferenceGateway:
    """Tenants, aliases, replicas and the router over one pool of model-server replicas."""

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
        training_prompts: TrainingPrompts | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.training_prompts = training_prompts or TrainingPrompts(db)
        """Records the prompts of tenants that allow training (the RLHF prompt pool)."""
        self.admission = admission or Admission(pool, clock=clock)
        self.autoscaler = autoscaler or Autoscaler(self.admission, clock=clock)
        self.responses = responses
        self.tenants = Tenants(
            db,
            cache,
            default_rpm_limit=default_rpm_limit,
            internal_token=internal_token,
            ttl_s=tenant_ttl_s,
            clock=clock,
        )
        self.keys = ApiKeys(db, self.tenants, ttl_s=tenant_ttl_s, monotonic=clock)
        """The tenants' API keys: scopes, expiry, rotation, revocation, usage."""
        self.aliases = Aliases(db, ttl_s=alias_ttl_s, clock=clock)
        self.replicas = Replicas(
            db,
            pool,
            self.autoscaler,
            metrics_interval_s=metrics_interval_s,
            replica_sync_s=replica_sync_s,
            clock=clock,
        )
        self.router = Router(
            pool,
            self.aliases,
            self.admission,
            self.autoscaler,
            responses=responses,
            upstream_priority=upstream_priority,
            upstream_attempts=upstream_attempts,
            clock=clock,
        )
        self.shadows = Shadows(db, self.router)
        self._timeout_s = request_timeout_s
        self._clock = clock

    def deadline(self, caller_remaining_s: float | None = None) -> float:
        """Absolute monotonic deadline: the gateway's timeout, or the caller's if that is sooner."""
        budget = self._timeout_s if caller_remaining_s is None else min(self._timeout_s, caller_remaining_s)
        return self._clock() + budget

    async def list_models(self) -> list[dict[str, object]]:
        """The models the healthy replicas serve, then every alias whose target one of them serves
        (the model it routes to now: see :meth:`ReplicaPool.serving`);
        each card only with the fields in :data:`PUBLIC_CARD_FIELDS` (a replica's ``root`` is its
        checkpoint's host path: tenants see the model id there). An empty pool (no replica
        configured, none added yet) serves nothing: an empty list; a pool whose every replica is
        unreachable is :class:`NoReplicaError`."""
        await self.pool.ensure_known()
        replicas = self.pool.replicas()
        cards: dict[str, dict[str, object]] = {}
        ready: dict[str, int] = {}
        # Every version each name is served at (replicas may serve one name at different
        # versions, as a canary does): an alias pinned to one of them is listed whichever
        # replica's card comes first.
        by_version: dict[tuple[str, str], dict[str, object]] = {}
        for replica in replicas:
            if not replica.healthy or replica.cards is None:
                continue
            for model_id, card in replica.cards.items():
                public = public_card(model_id, card)
                cards.setdefault(model_id, public)
                by_version.setdefault((model_id, str(public.get("version") or "")), public)
                ready[model_id] = ready.get(model_id, 0) + 1
        if not cards:
            for replica in replicas:
                error = replica.models_error or replica.last_error
                if error is not None:
                    raise error
            if replicas and not any(r.healthy for r in replicas):
                raise NoReplicaError("no healthy model-server replica", self.pool.retry_after_s())
        served = {model_id: {**card, "ready_replicas": ready[model_id]} for model_id, card in cards.items()}
        listed = list(served.values())
        for alias in await self.aliases.list_aliases():
            # What the alias answers with now: its model, or the one before while none serves it.
            model = self.pool.serving(alias.model, alias.previous)
            found = served.get(model.name)
            if found is None or alias.alias in served:
                continue
            if model.pinned and (model.name, model.version) in by_version:
                found = {**by_version[(model.name, model.version)], "ready_replicas": found["ready_replicas"]}
            version = str(found.get("version") or "")
            if model.pinned and version and version != model.version:
                continue  # the replicas serve another version of the name: the alias cannot answer
            entry: dict[str, object] = {
                **found,
                "id": alias.alias,
                "alias_of": str(model),
                "version": model.version or version,
            }
            if alias.canary_target and alias.canary_weight:
                entry["canary"] = {"model": alias.canary_target, "weight": alias.canary_weight}
            listed.append(entry)
        return listed

    async def tokenizer_info(self, target: ModelRef, deadline: float) -> Reply:
        """vLLM's ``GET /tokenizer_info`` of the model ``target`` from a healthy replica serving it."""
        for replica in self.pool.candidates(target):
            try:
                return await replica.client.request(
                    "GET", f"/tokenizer_info?{urlencode({'model': str(target)})}", deadline
                )
            except UpstreamUnavailableError as exc:
                self.pool.report_failure(replica, exc)
        raise self.pool.no_replica(target)

    async def count_tokens(
        self, target: ModelRef, messages: list[dict[str, str]], deadline: float
    ) -> int | None:
        """Prompt tokens of chat ``messages`` for the model ``target``, counted by a replica that
        serves it with its own tokenizer and chat template (vLLM's ``POST /tokenize``); None when
        no healthy replica answers the route (the caller then estimates)."""
        body = {"model": str(target), "messages": messages}
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

    async def generate(
        self, tenant: Tenant, body: dict[str, object], *, chat: bool, deadline: float
    ) -> AsyncIterator[tuple[ModelRef, StreamChunk]]:
        """Stream an OpenAI request as text pieces then one final chunk (the gRPC API's view), each
        with the model version that answers it."""
        path = "/v1/chat/completions" if chat else "/v1/completions"
        request = GenerationRequest.parse({**body, "stream": True, "stream_options": {"include_usage": True}})
        await self.training_prompts.record(tenant, body)
        routed = await self.router.route(tenant, path, request)
        forwarded = await self.router.forward(routed, deadline)
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
