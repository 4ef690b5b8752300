"""The public OpenAI-compatible HTTP API and the admin API: translation only.

``/v1/*`` takes a tenant API key (``Authorization: Bearer <key>``); ``/admin/v1/*`` takes the
service's own token. Upstream answers pass through as they are (a 404 from the model server stays
a 404 with its body, except that an alias whose model no replica lists is a 404 naming the alias;
a stream is relayed byte for byte); the gateway's own errors use the OpenAI
error format too: 401 without a valid key, 429 with ``Retry-After`` over the rate limit or when the
model's queue sheds the request, 503 with ``Retry-After`` when no replica can be reached, 504 past
the deadline — never a stack trace. Every answer that went through routing names the model version
that served it in ``x-forge-model``; a deterministic request says ``x-forge-cache: hit|miss``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import asdict
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import Counter
from pydantic import BaseModel, Field, StrictBool

from forge_inference_gateway.caching.response_cache import CACHE_HEADER
from forge_inference_gateway.embeddings import GrpcEmbedder, create_embeddings
from forge_inference_gateway.keys.api import install_key_api, require_scope
from forge_inference_gateway.openai_schema import bearer_scheme, check_generation, install_openapi
from forge_inference_gateway.rag.chat import chat_chunks, chat_completion, rag_tokens
from forge_inference_gateway.rag.service import RagService
from forge_inference_gateway.replicas.metering import TAIL_BYTES, usage_of
from forge_inference_gateway.replicas.upstream import (
    StreamBroken,
    UpstreamError,
    UpstreamUnavailableError,
    error_for,
)
from forge_inference_gateway.routing.aliases import Alias
from forge_inference_gateway.routing.router import MODEL_HEADER, GenerationRequest
from forge_inference_gateway.service import InferenceGateway
from forge_inference_gateway.tenants.registry import PRIORITY_CLASSES
from forge_inference_gateway.vector_stores.api import install_vector_store_api, name_store
from forge_inference_gateway.vector_stores.service import VectorStores
from forge_kit import errors
from forge_kit.http import reject_unknown_query, require_token
from forge_kit.openai_errors import install_openai_error_handlers, openai_error
from forge_kit.openai_protocol import DetokenizeBody, TokenizeBody, parse
from forge_kit.validate import loads_json

REQUESTS = Counter("forge_gateway_requests_total", "Public API requests answered", ["route", "status"])
#: Request header that keeps a canary split sticky for a session when the body has no ``user``.
SESSION_HEADER = "x-session-id"


def _sse_error(message: str, type_: str) -> bytes:
    error = {"error": {"message": message, "type": type_, "param": None, "code": None}}
    return f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()


class TenantBody(BaseModel):
    name: str
    priority_class: str = PRIORITY_CLASSES[0]
    rpm_limit: int | None = Field(default=None, le=10**9)
    allow_training: StrictBool = False
    """Whether the tenant's prompts may be used for training (RLHF prompt pool); off by default."""


class TrainingBody(BaseModel):
    allow_training: StrictBool


class ModelRefBody(BaseModel):
    name: str
    version: str = ""


class CanaryBody(BaseModel):
    model: ModelRefBody
    weight: int = Field(ge=0, le=100)


class AliasBody(BaseModel):
    model: ModelRefBody


class ShadowBody(BaseModel):
    model: ModelRefBody
    percent: int = Field(ge=0, le=100)


class ReplicaBody(BaseModel):
    url: str
    token: str = Field(default="", max_length=512)
    """The bearer token the replica accepts, issued for it (empty: none)."""


def _bearer(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    return key.strip() if scheme.lower() == "bearer" else ""


class GatewayRoutes:
    def __init__(
        self,
        gateway: InferenceGateway,
        rag: RagService | None = None,
        embedder: GrpcEmbedder | None = None,
        stores: VectorStores | None = None,
    ) -> None:
        self._gateway = gateway
        self._rag = rag
        self._embedder = embedder
        self._stores = stores

    async def admit(self, request: Request) -> None:
        """Dependency of ``/v1``: authenticate, admit against the tenant's rate limit, remember who."""
        tenant, grant = await self._gateway.keys.authenticate(_bearer(request))
        await self._gateway.tenants.admit(tenant)
        request.state.tenant = tenant
        request.state.key = grant
        self._gateway.keys.record(tenant, grant, requests=1)
        request.state.record = functools.partial(self._gateway.keys.record, tenant, grant)

    async def _models(self, tenant: str) -> list[dict[str, object]]:
        """The replicas' models and aliases, then the embedding model (``type`` ``embedding``)."""
        cards = await self._gateway.list_models()
        embedding = await self._embedder.card(tenant) if self._embedder is not None else None
        return [*cards, embedding] if embedding is not None else cards

    async def list_models(self, request: Request) -> dict[str, object]:
        return {"object": "list", "data": await self._models(request.state.tenant.name)}

    async def retrieve_model(self, request: Request, model_id: str) -> Response:
        """``GET /v1/models/{id}`` (the SDK's ``models.retrieve``): the card ``/v1/models`` lists."""
        for card in await self._models(request.state.tenant.name):
            if card.get("id") == model_id:
                return JSONResponse(card)
        return openai_error(
            404, f"the model `{model_id}` does not exist", param="model", code="model_not_found"
        )

    async def embeddings(self, request: Request) -> Response:
        """``POST /v1/embeddings``: the retriever's embedder, for the caller's tenant."""
        if self._embedder is None:
            raise errors.NotFoundError("embeddings are not configured on this gateway")
        raw = _json_body(await request.body())
        answer = await create_embeddings(self._embedder, request.state.tenant, raw)
        usage = answer.get("usage")
        if isinstance(usage, dict):
            request.state.record(tokens=int(usage.get("total_tokens") or usage.get("prompt_tokens") or 0))
        REQUESTS.labels("/v1/embeddings", "200").inc()
        return JSONResponse(answer)

    async def completions(self, request: Request) -> Response:
        raw = _json_body(await request.body())
        check_generation("/v1/completions", raw)
        return await self._forward("/v1/completions", request, raw)

    # vLLM's tokenizer routes, answered by a replica serving the model: what a harness needs of a
    # served name's tokenizer without its files (lm-evaluation-harness's remote tokenizer, which
    # sends no ``model``, and ``forge eval``'s context/continuation split). Nothing is recorded.

    async def _with_model(self, raw: object) -> dict[str, object]:
        """``raw`` (without ``stream``) with ``model`` set: as sent, or the one model (not an
        alias) the replicas serve."""
        if not isinstance(raw, dict):
            raise errors.ValidationError("body", "must be a JSON object")
        raw = {k: v for k, v in raw.items() if k != "stream"}  # these answers are never streamed
        if raw.get("model") is not None:
            return raw
        models = sorted({str(c["id"]) for c in await self._gateway.list_models() if "alias_of" not in c})
        if len(models) != 1:
            raise errors.ValidationError("model", f"is required: this gateway serves {len(models)} models")
        return {**raw, "model": models[0]}

    async def tokenize(self, request: Request) -> Response:
        """``POST /tokenize``: the served model's token ids for a prompt."""
        raw = await self._with_model(_json_body(await request.body()))
        parse(TokenizeBody, raw)
        return _route_missing("/tokenize", await self._forward("/tokenize", request, raw, record=False))

    async def detokenize(self, request: Request) -> Response:
        """``POST /detokenize``: the text of token ids."""
        raw = await self._with_model(_json_body(await request.body()))
        parse(DetokenizeBody, raw)
        return _route_missing("/detokenize", await self._forward("/detokenize", request, raw, record=False))

    async def tokenizer_info(
        self, request: Request, model: Annotated[str | None, Query(max_length=256)] = None
    ) -> Response:
        """``GET /tokenizer_info``: the model's special tokens and chat template."""
        raw = await self._with_model({"model": model})
        routed = await self._gateway.router.route(
            request.state.tenant, "/tokenizer_info", GenerationRequest.parse(raw)
        )
        reply = await self._gateway.tokenizer_info(routed.model, self._gateway.deadline())
        headers = {
            MODEL_HEADER: routed.target,
            "content-type": reply.headers.get("content-type", "application/json"),
        }
        return _route_missing(
            "/tokenizer_info", self._relay("/tokenizer_info", reply.status_code, reply.content, headers)
        )

    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/chat/completions``: relayed to a replica, or, with a ``retrieval`` object,
        answered over the tenant's documents (the RAG path on the last user message) in the chat
        completion format, the passages and citations under ``retrieval``."""
        raw = _json_body(await request.body())
        if isinstance(raw, dict) and "retrieval" in raw:
            return await self._chat_with_retrieval(request, raw)
        check_generation("/v1/chat/completions", raw)
        return await self._forward("/v1/chat/completions", request, raw)

    async def _chat_with_retrieval(self, request: Request, raw: dict[str, object]) -> Response:
        if self._rag is None:
            raise errors.NotFoundError("retrieval is not configured on this gateway")
        await require_scope("rag:read")(request)
        named = await name_store(self._stores, request.state.tenant, raw, "retrieval")
        plan = await self._rag.prepare_chat(request.state.tenant, named)
        cache = {CACHE_HEADER: "hit" if plan.cached is not None else "miss"}
        created = int(time.time())
        REQUESTS.labels("/v1/chat/completions", "200").inc()
        if not plan.query.stream:
            answer = await self._rag.answer(plan)
            request.state.record(tokens=rag_tokens(answer))
            return JSONResponse(chat_completion(answer, created), headers=cache)
        return StreamingResponse(
            self._rag_events(
                chat_chunks(self._rag.stream(plan), created), plan.deadline, request.state.record
            ),
            media_type="text/event-stream",
            headers=cache | {"Cache-Control": "no-cache"},
        )

    async def rag_query(self, request: Request) -> Response:
        """``POST /v1/rag/query``: JSON answer, or SSE ``rag.answer.delta`` events then ``rag.answer``."""
        if self._rag is None:
            raise errors.NotFoundError("retrieval is not configured on this gateway")
        body = await name_store(self._stores, request.state.tenant, _json_body(await request.body()))
        plan = await self._rag.prepare(request.state.tenant, body)
        cache = {CACHE_HEADER: "hit" if plan.cached is not None else "miss"}
        if not plan.query.stream:
            result = await self._rag.answer(plan)
            request.state.record(tokens=rag_tokens(result))
            REQUESTS.labels("/v1/rag/query", "200").inc()
            return JSONResponse(result, headers=cache)
        REQUESTS.labels("/v1/rag/query", "200").inc()
        return StreamingResponse(
            self._rag_events(self._rag.stream(plan), plan.deadline, request.state.record),
            media_type="text/event-stream",
            headers=cache | {"Cache-Control": "no-cache"},
        )

    @staticmethod
    async def _rag_events(
        events: AsyncIterator[dict[str, object]], deadline: float, record: Callable[..., None]
    ) -> AsyncIterator[bytes]:
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                async for event in events:
                    if "usage" in event:  # the last event: the whole answer's usage
                        record(tokens=rag_tokens(event))
                    yield f"data: {json.dumps(event)}\n\n".encode()
            yield b"data: [DONE]\n\n"
        except TimeoutError:
            yield _sse_error("deadline exceeded", "timeout")
        except (StreamBroken, UpstreamError, errors.ForgeError) as exc:
            yield _sse_error(f"answer failed: {exc}", "upstream_error")
        finally:
            if isinstance(events, AsyncGenerator):
                await events.aclose()

    async def _forward(self, path: str, request: Request, raw: object, *, record: bool = True) -> Response:
        deadline = self._gateway.deadline()
        parsed = GenerationRequest.parse(raw)
        if record:
            await self._gateway.training_prompts.record(request.state.tenant, parsed.body)
        routed = await self._gateway.router.route(
            request.state.tenant,
            path,
            parsed,
            session_key=request.headers.get(SESSION_HEADER),
        )
        forwarded = await self._gateway.router.forward(routed, deadline)
        if forwarded.chunks is None:
            if routed.shadow is not None and forwarded.status == 200:
                self._gateway.shadows.mirror(routed, forwarded)
            if forwarded.status == 200:
                request.state.record(tokens=_metered(forwarded.content))
            return self._relay(path, forwarded.status, forwarded.content, forwarded.headers)
        REQUESTS.labels(path, "200").inc()
        return StreamingResponse(
            self._relay_stream(forwarded.chunks, deadline, request.state.record),
            status_code=200,
            media_type="text/event-stream",
            headers={k: v for k, v in forwarded.headers.items() if k != "content-type"}
            | {"Cache-Control": "no-cache"},
        )

    @staticmethod
    async def _relay_stream(
        chunks: AsyncGenerator[bytes, None], deadline: float, record: Callable[..., None]
    ) -> AsyncIterator[bytes]:
        # The upstream connection is closed when this generator ends for any reason, including
        # the client going away (Starlette cancels it), which cancels the request upstream.
        tail = b""
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                async for chunk in chunks:
                    tail = (tail + chunk)[-TAIL_BYTES:]
                    yield chunk
            record(tokens=_metered(tail))
        except TimeoutError:
            yield _sse_error("deadline exceeded", "timeout")
        except StreamBroken as exc:
            # Headers are sent: the failure can only travel as an event, as vLLM reports it mid-stream.
            yield _sse_error(f"model server stream broke: {type(exc).__name__}", "upstream_error")
        finally:
            await chunks.aclose()

    @staticmethod
    def _relay(path: str, status: int, content: bytes, headers: Mapping[str, str]) -> Response:
        # The caller can act on the upstream's 4xx; a 5xx or a refusal of the gateway's own
        # credentials is the gateway's problem, reported without the upstream's body.
        if status in (401, 403) or (status >= 500 and status != 503):
            REQUESTS.labels(path, "502").inc()
            message = error_for(status, content).message
            served = {MODEL_HEADER: headers[MODEL_HEADER]} if MODEL_HEADER in headers else None
            return openai_error(502, message, type_="upstream_error", code="bad_gateway", headers=served)
        REQUESTS.labels(path, str(status)).inc()
        relayed = dict(headers)
        if status == 503:
            relayed.setdefault("retry-after", "1")
        return Response(content=content, status_code=status, headers=relayed)


def _route_missing(path: str, answer: Response) -> Response:
    """A replica's 404 that is not an OpenAI error is its server lacking ``path`` (vLLM answers
    ``/tokenizer_info`` only with ``--enable-tokenizer-info-endpoint``): said so, in the OpenAI
    error format."""
    if answer.status_code != 404 or not isinstance(answer.body, bytes):
        return answer
    try:
        error = json.loads(answer.body).get("error")
    except (ValueError, AttributeError):
        error = None
    if isinstance(error, dict):
        return answer
    message = f"the model server serving this model does not answer {path}"
    return openai_error(404, message, type_="not_found_error", code="route_not_found")


def _json_body(body: bytes) -> object:
    # Standard JSON only: a NaN or Infinity literal never reaches a numeric field.
    return loads_json(body)


def _metered(content: bytes) -> int:
    """Prompt plus completion tokens an answer's (or a stream tail's) usage reports."""
    usage = usage_of(content)
    return usage.get("prompt", 0) + usage.get("completion", 0)


def _alias_view(alias: Alias) -> dict[str, object]:
    return {
        "alias": alias.alias,
        "model": {"name": alias.model_name, "version": alias.model_version},
        "stage": alias.stage,
        "updated_at": alias.updated_at,
        "canary": (
            {
                "model": {"name": alias.canary_name, "version": alias.canary_version},
                "weight": alias.canary_weight,
            }
            if alias.canary_name
            else None
        ),
        "shadow": (
            {
                "model": {"name": alias.shadow_name, "version": alias.shadow_version},
                "percent": alias.shadow_percent,
            }
            if alias.shadow is not None
            else None
        ),
    }


class AdminRoutes:
    def __init__(self, gateway: InferenceGateway) -> None:
        self._gateway = gateway

    async def aliases(self) -> dict[str, object]:
        return {"aliases": [_alias_view(a) for a in await self._gateway.aliases.list_aliases()]}

    async def set_canary(self, alias: str, body: CanaryBody) -> dict[str, object]:
        updated = await self._gateway.aliases.set_canary(
            alias, body.model.name, body.model.version, body.weight
        )
        return _alias_view(updated)

    async def set_alias(self, alias: str, body: AliasBody) -> dict[str, object]:
        return _alias_view(await self._gateway.aliases.set_alias(alias, body.model.name, body.model.version))

    async def set_shadow(self, alias: str, body: ShadowBody) -> dict[str, object]:
        updated = await self._gateway.aliases.set_shadow(
            alias, body.model.name, body.model.version, body.percent
        )
        return _alias_view(updated)

    async def stop_shadow(self, alias: str) -> dict[str, object]:
        return _alias_view(await self._gateway.aliases.set_shadow(alias, "", "", 0))

    async def shadow_pairs(self, alias: str = "", after_id: int = 0, limit: int = 100) -> dict[str, object]:
        pairs = await self._gateway.shadows.pairs(alias, after_id, limit)
        return {"pairs": pairs, "next_after_id": pairs[-1]["id"] if pairs else after_id}

    async def rollback_canary(self, alias: str) -> dict[str, object]:
        return _alias_view(await self._gateway.aliases.rollback_canary(alias))

    async def tenants(self) -> dict[str, object]:
        return {"tenants": [t.__dict__ for t in await self._gateway.tenants.list_tenants()]}

    async def create_tenant(self, body: TenantBody) -> JSONResponse:
        tenant, api_key = await self._gateway.tenants.create_tenant(
            body.name, body.priority_class, body.rpm_limit, allow_training=body.allow_training
        )
        await self._gateway.keys.note(
            tenant.name,
            "tenant.created",
            {
                "priority_class": tenant.priority_class,
                "rpm_limit": tenant.rpm_limit,
                "allow_training": tenant.allow_training,
            },
        )
        return JSONResponse({"tenant": tenant.__dict__, "api_key": api_key}, status_code=201)

    async def set_training(self, name: str, body: TrainingBody) -> dict[str, object]:
        """Opt a tenant in to or out of training on its prompts."""
        tenant = await self._gateway.tenants.set_training(name, body.allow_training)
        await self._gateway.keys.note(name, "tenant.training", {"allow_training": body.allow_training})
        return {"tenant": tenant.__dict__}

    async def training_prompts(
        self,
        after: Annotated[int, Query(ge=0, le=2**62)] = 0,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> dict[str, object]:
        """The RLHF prompt pool's production part: prompts of tenants that allow training."""
        prompts = await self._gateway.training_prompts.pool(after=after, limit=limit)
        return {"prompts": [asdict(p) for p in prompts], "next_after": prompts[-1].seq if prompts else after}

    async def replicas(self) -> dict[str, object]:
        return {"replicas": [r.view() for r in self._gateway.pool.replicas()]}

    async def add_replica(self, body: ReplicaBody) -> JSONResponse:
        replica = await self._gateway.replicas.add_replica(body.url, body.token)
        return JSONResponse(replica.view(), status_code=201)

    async def remove_replica(self, url: str) -> Response:
        await self._gateway.replicas.remove_replica(url)
        return Response(status_code=204)

    async def autoscaling(self) -> dict[str, object]:
        return {"models": [asdict(r) for r in self._gateway.autoscaler.publish()]}


def install_gateway_api(
    app: FastAPI,
    gateway: InferenceGateway,
    admin_token: str | None,
    rag: RagService | None = None,
    embedder: GrpcEmbedder | None = None,
    stores: VectorStores | None = None,
) -> None:
    """Add ``/v1/*`` (``/v1/rag/query`` with ``rag``, ``/v1/embeddings`` with ``embedder``,
    ``/v1/files`` and ``/v1/vector_stores`` with ``stores``), ``/admin/v1/*`` and OpenAI-format
    error handlers."""
    public = GatewayRoutes(gateway, rag, embedder, stores)
    tenant = [Depends(bearer_scheme), Depends(public.admit)]

    def scoped(scope: str) -> list[Any]:
        return [*tenant, Depends(require_scope(scope))]

    app.add_api_route("/v1/models", public.list_models, methods=["GET"], dependencies=tenant)
    app.add_api_route(
        "/v1/models/{model_id:path}", public.retrieve_model, methods=["GET"], dependencies=tenant
    )
    inference = scoped("inference")
    app.add_api_route("/v1/completions", public.completions, methods=["POST"], dependencies=inference)
    app.add_api_route(
        "/v1/chat/completions", public.chat_completions, methods=["POST"], dependencies=inference
    )
    app.add_api_route("/tokenize", public.tokenize, methods=["POST"], dependencies=inference)
    app.add_api_route("/detokenize", public.detokenize, methods=["POST"], dependencies=inference)
    app.add_api_route("/tokenizer_info", public.tokenizer_info, methods=["GET"], dependencies=inference)
    app.add_api_route("/v1/rag/query", public.rag_query, methods=["POST"], dependencies=scoped("rag:read"))
    app.add_api_route(
        "/v1/embeddings", public.embeddings, methods=["POST"], dependencies=scoped("embeddings")
    )
    if stores is not None:
        install_vector_store_api(app, stores, read=scoped("rag:read"), write=scoped("rag:write"))
    admin = AdminRoutes(gateway)
    # Admin routes refuse query parameters they do not declare (the public /v1 routes stay as
    # lenient as OpenAI's own API).
    auth = [Depends(bearer_scheme), Depends(require_token(admin_token)), Depends(reject_unknown_query)]
    for path, endpoint, method, status in (
        ("/admin/v1/aliases", admin.aliases, "GET", 200),
        ("/admin/v1/aliases/{alias}", admin.set_alias, "PUT", 200),
        ("/admin/v1/aliases/{alias}/canary", admin.set_canary, "PUT", 200),
        ("/admin/v1/aliases/{alias}/canary", admin.rollback_canary, "DELETE", 200),
        ("/admin/v1/aliases/{alias}/shadow", admin.set_shadow, "PUT", 200),
        ("/admin/v1/aliases/{alias}/shadow", admin.stop_shadow, "DELETE", 200),
        ("/admin/v1/shadow/pairs", admin.shadow_pairs, "GET", 200),
        ("/admin/v1/tenants", admin.tenants, "GET", 200),
        ("/admin/v1/tenants", admin.create_tenant, "POST", 201),
        ("/admin/v1/tenants/{name}/training", admin.set_training, "PUT", 200),
        ("/admin/v1/training-prompts", admin.training_prompts, "GET", 200),
        ("/admin/v1/replicas", admin.replicas, "GET", 200),
        ("/admin/v1/replicas", admin.add_replica, "POST", 201),
        ("/admin/v1/replicas", admin.remove_replica, "DELETE", 204),
        ("/admin/v1/autoscaling", admin.autoscaling, "GET", 200),
    ):
        app.add_api_route(path, endpoint, methods=[method], dependencies=auth, status_code=status)
    install_key_api(app, gateway.keys, tenant, auth)

    install_openai_error_handlers(app)
    install_openapi(app)

    @app.exception_handler(UpstreamUnavailableError)
    async def _unavailable(_: Request, exc: UpstreamUnavailableError) -> JSONResponse:
        retry = str(max(1, math.ceil(exc.retry_after_s)))
        return openai_error(
            503, exc.message, type_="upstream_error", code="unavailable", headers={"Retry-After": retry}
        )

    @app.exception_handler(UpstreamError)
    async def _bad_gateway(_: Request, exc: UpstreamError) -> JSONResponse:
        return openai_error(502, exc.message, type_="upstream_error", code="bad_gateway")

    @app.exception_handler(TimeoutError)
    async def _timeout(_: Request, exc: TimeoutError) -> JSONResponse:
        return openai_error(504, "deadline exceeded", type_="timeout", code="deadline_exceeded")
