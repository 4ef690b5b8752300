from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from forge.common.v1 import common_pb2
from forge.events.v1 import events_pb2

from forge_inference_gateway.caching.response_cache import ResponseCache
from forge_inference_gateway.openai_api import install_gateway_api
from forge_inference_gateway.replicas.pool import ReplicaPool, RoutingPolicy
from forge_inference_gateway.replicas.upstream import ModelServerClient
from forge_inference_gateway.routing.admission import Admission, AdmissionPolicy
from forge_inference_gateway.service import InferenceGateway
from forge_kit.cache import Cache, InMemoryCache
from forge_kit.db import Database
from forge_kit.events import new_meta
from forge_kit.http import make_app

MIGRATIONS = Path(__file__).parents[1] / "src" / "forge_inference_gateway" / "migrations"
ADMIN_TOKEN = "admin-token"
API_KEY = "tenant-key"


class FakeClock:
    """Monotonic seconds the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def db_migrations() -> Path:
    """This service's migrations, for forge_kit.testing's ``db`` fixture."""
    return MIGRATIONS


@pytest.fixture
def api_key() -> str:
    """The bootstrap tenant's key in these tests."""
    return API_KEY


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def upstream_url() -> str:
    """Where the gateway's model server is; tests that reach a real one override this fixture."""
    return "http://model-server.invalid"


@pytest.fixture
async def gateway(db: Database, clock: FakeClock, upstream_url: str) -> AsyncIterator[InferenceGateway]:
    pool = ReplicaPool(
        [upstream_url] if upstream_url else [],  # "": none configured, as MODEL_SERVER_URL=""
        lambda url: ModelServerClient(url, "upstream-token"),
        RoutingPolicy(eject_base_s=1.0),
    )
    service = InferenceGateway(
        db,
        InMemoryCache(clock=clock),
        pool,
        responses=ResponseCache(InMemoryCache()),
        default_rpm_limit=5,
        request_timeout_s=10,
        internal_token=ADMIN_TOKEN,
    )
    await service.tenants.bootstrap(API_KEY)
    yield service
    await pool.close()


@pytest.fixture
async def http(gateway: InferenceGateway) -> AsyncIterator[httpx.AsyncClient]:
    """The gateway's HTTP API in process, authenticated as the bootstrap tenant."""
    app = make_app("inference_gateway")
    install_gateway_api(app, gateway, ADMIN_TOKEN)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(
        transport=transport,
        base_url="http://gateway",
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=15,
    ) as client:
        yield client


def model_promoted(
    name: str,
    version: str,
    stage: str = "production",
    *,
    traffic: int = 100,
    previous: str = "",
    rollback: bool = False,
) -> events_pb2.ModelPromoted:
    """A ModelPromoted event of ``name:version`` to ``stage`` (``previous``: the version it replaces)."""
    event = events_pb2.ModelPromoted(
        meta=new_meta("eval"),
        model=common_pb2.ModelRef(name=name, version=version),
        stage=stage,
        traffic_percent=traffic,
        is_rollback=rollback,
        reason="test",
    )
    if previous:
        event.previous.CopyFrom(common_pb2.ModelRef(name=name, version=previous))
    return event


async def apply_promotions(
    gateway: InferenceGateway, db: Database, *events: events_pb2.ModelPromoted
) -> None:
    """Apply ``events`` to the gateway's aliases as its event consumer does, in one transaction."""
    async with db.session() as session:
        for event in events:
            await gateway.aliases.apply_model_promoted(event, session)


@pytest.fixture
def promoted() -> Callable[..., events_pb2.ModelPromoted]:
    """``promoted("tiny", "3", stage="production")``: a ModelPromoted event as eval publishes it."""

    def build(name: str, version: str = "", stage: str = "production") -> events_pb2.ModelPromoted:
        return events_pb2.ModelPromoted(
            meta=new_meta("eval"),
            model=common_pb2.ModelRef(name=name, version=version),
            stage=stage,
            traffic_percent=100,
            reason="gate passed",
        )

    return build


# What a vLLM-protocol server streams for a two-token chat completion with usage.
RECORDED_SSE = (
    b"".join(
        f"data: {json.dumps(e)}\n\n".encode()
        for e in [
            {
                "id": "chatcmpl-1",
                "object": "chat.completion.chunk",
                "model": "tiny",
                "choices": [
                    {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                ],
            },
            {
                "id": "chatcmpl-1",
                "object": "chat.completion.chunk",
                "model": "tiny",
                "choices": [{"index": 0, "delta": {"content": "To be"}, "finish_reason": None}],
            },
            {
                "id": "chatcmpl-1",
                "object": "chat.completion.chunk",
                "model": "tiny",
                "choices": [{"index": 0, "delta": {"content": ", or not"}, "finish_reason": "length"}],
            },
            {
                "id": "chatcmpl-1",
                "object": "chat.completion.chunk",
                "model": "tiny",
                "choices": [],
                "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
            },
        ]
    )
    + b"data: [DONE]\n\n"
)


class LocalServer:
    """An ASGI app served by uvicorn on a free 127.0.0.1 port, in the test's event loop."""

    def __init__(self) -> None:
        self.port = 0
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def serve(self, app: FastAPI, port: int = 0) -> None:
        config = uvicorn.Config(
            app, host="127.0.0.1", port=port, log_config=None, lifespan="off", timeout_graceful_shutdown=0
        )
        self._server = uvicorn.Server(config)
        self._server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)
        self.port = int(self._server.servers[0].sockets[0].getsockname()[1])

    async def stop(self) -> None:
        """Stop answering at once: open connections are dropped, as when a replica dies."""
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            self._server.force_exit = True
            await self._task
            self._server = self._task = None


@dataclass(frozen=True)
class SentRequest:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


class RecordedUpstream(LocalServer):
    """A real HTTP server that replays recorded model-server answers and keeps what the gateway sent:
    the SSE above for streamed ``tiny``, a 404 in the OpenAI format for other models, and a 500 with
    a trace for a whole ``tiny`` answer."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[SentRequest] = []
        self.sse = RECORDED_SSE

    async def start(self) -> RecordedUpstream:
        app = FastAPI()
        app.add_api_route("/metrics", lambda: PlainTextResponse(RECORDED_METRICS), methods=["GET"])
        app.add_api_route("/v1/models", self._models, methods=["GET"])
        app.add_api_route("/v1/completions", self._generate, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self._generate, methods=["POST"])
        await self.serve(app)
        return self

    @staticmethod
    def _models() -> dict[str, object]:
        card = {"id": "tiny", "object": "model", "owned_by": "forge", "max_model_len": 64, "version": "7"}
        return {"object": "list", "data": [card]}

    async def _generate(self, request: Request) -> Response:
        body = json.loads(await request.body())
        self.requests.append(SentRequest(request.url.path, dict(request.headers), body))
        if body["model"] != "tiny":
            error = {
                "message": f"The model `{body['model']}` does not exist.",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
            return JSONResponse({"error": error}, status_code=404)
        if body.get("stream"):
            return Response(RECORDED_SSE, media_type="text/event-stream")
        return PlainTextResponse("Traceback (most recent call last): ...", status_code=500)


RECORDED_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="tiny"} 0.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="tiny"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="tiny"} 0.0
"""


@pytest.fixture
async def recorded() -> AsyncIterator[RecordedUpstream]:
    """Recorded model-server answers; a module opts in with ``upstream_url`` returning its url."""
    server = await RecordedUpstream().start()
    yield server
    await server.stop()


class ProtocolReplica(LocalServer):
    """A real HTTP server on a free port that speaks the vLLM protocol, with a toy engine.

    ``/v1/completions`` and ``/v1/chat/completions`` (whole or streamed as SSE, usage included),
    ``/v1/models``, ``/health`` and ``/metrics`` with vLLM's gauge names, which report this
    server's true state: at most ``max_running`` requests run at once, the rest wait. A request
    produces ``max_tokens`` tokens (`` t0 t1 …``), one every ``token_delay_s``; while ``hold()``
    is in force, running requests stop after their first token until ``release()``. Every
    request body it received is kept in ``bodies``. ``kv_usage`` overrides the reported KV use.
    """

    def __init__(
        self, model: str = "tiny", version: str = "", max_running: int = 8, token_delay_s: float = 0.0
    ) -> None:
        self.model = model
        self.version = version
        self.max_running = max_running
        self.token_delay_s = token_delay_s
        self.bodies: list[dict[str, object]] = []
        self.waiting = 0
        self.running = 0
        self.kv_usage: float | None = None
        super().__init__()
        self._slots = asyncio.Semaphore(max_running)
        self._go = asyncio.Event()
        self._go.set()

    def hold(self) -> None:
        self._go.clear()

    def release(self) -> None:
        self._go.set()

    async def start(self, port: int = 0) -> ProtocolReplica:
        app = FastAPI()
        app.add_api_route("/health", lambda: {}, methods=["GET"])
        app.add_api_route("/metrics", self._metrics, methods=["GET"])
        app.add_api_route("/v1/models", self._models, methods=["GET"])
        app.add_api_route("/v1/completions", self._completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self._chat, methods=["POST"])
        await self.serve(app, port)
        return self

    async def stop(self) -> None:
        self.release()
        await super().stop()

    def _metrics(self) -> PlainTextResponse:
        kv = self.kv_usage if self.kv_usage is not None else self.running / self.max_running
        labels = f'{{model_name="{self.model}"}}'
        return PlainTextResponse(
            f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{labels} {float(self.waiting)}\n"
            f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{labels} {float(self.running)}\n"
            f"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{labels} {kv}\n"
        )

    def _models(self) -> dict[str, object]:
        card = {"id": self.model, "object": "model", "max_model_len": 256, "version": self.version}
        return {"object": "list", "data": [card]}

    async def _completions(self, request: Request) -> Response:
        return await self._generate(await request.json(), chat=False)

    async def _chat(self, request: Request) -> Response:
        return await self._generate(await request.json(), chat=True)

    async def _generate(self, body: dict[str, Any], *, chat: bool) -> Response:
        self.bodies.append(body)
        if body.get("model") not in (self.model, f"{self.model}:{self.version}"):
            error = {"message": f"The model `{body.get('model')}` does not exist.", "type": "invalid_request_error",
                     "param": "model", "code": "model_not_found"}  # fmt: skip
            return JSONResponse({"error": error}, status_code=404)
        n = int(body.get("max_tokens") or 4)
        request_id = f"cmpl-{uuid.uuid4().hex[:8]}"

        def event(text: str | None, finish: str | None) -> dict[str, object]:
            choice: dict[str, object] = {"index": 0, "finish_reason": finish}
            if chat:
                choice["delta"] = {"content": text} if text is not None else {}
            else:
                choice["text"] = text or ""
            return {"id": request_id, "object": "chunk", "model": body["model"], "choices": [choice]}

        async def tokens() -> AsyncIterator[str]:
            self.waiting += 1
            try:
                await self._slots.acquire()
            finally:
                self.waiting -= 1
            self.running += 1
            try:
                for i in range(n):
                    if self.token_delay_s:
                        await asyncio.sleep(self.token_delay_s)
                    yield f" t{i}"
                    if i == 0:
                        await self._go.wait()
            finally:
                self.running -= 1
                self._slots.release()

        usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}
        if not body.get("stream"):
            text = "".join([t async for t in tokens()])
            choice = {"index": 0, "finish_reason": "length"} | (
                {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            )
            return JSONResponse({"id": request_id, "object": "completion", "model": body["model"],
                                 "choices": [choice], "usage": usage})  # fmt: skip

        async def sse() -> AsyncIterator[bytes]:
            async for token in tokens():
                yield f"data: {json.dumps(event(token, None))}\n\n".encode()
            yield f"data: {json.dumps(event(None, 'length'))}\n\n".encode()
            if (body.get("stream_options") or {}).get("include_usage"):
                final = {
                    "id": request_id,
                    "object": "chunk",
                    "model": body["model"],
                    "choices": [],
                    "usage": usage,
                }
                yield f"data: {json.dumps(final)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")


@pytest.fixture
async def replicas() -> AsyncIterator[Callable[..., Awaitable[ProtocolReplica]]]:
    """``await replicas(max_running=2, ...)``: a started :class:`ProtocolReplica`, stopped after the test."""
    started: list[ProtocolReplica] = []

    async def start(**kwargs: Any) -> ProtocolReplica:
        replica = await ProtocolReplica(**kwargs).start()
        started.append(replica)
        return replica

    yield start
    for replica in started:
        await replica.stop()


def build_gateway(
    db: Database,
    urls: list[str],
    *,
    policy: RoutingPolicy | None = None,
    admission: AdmissionPolicy | None = None,
    cache: Cache | None = None,
    clock: Callable[[], float] = time.monotonic,
    request_timeout_s: float = 10,
    **kwargs: Any,
) -> InferenceGateway:
    """A gateway over real replicas at ``urls`` (see :class:`ProtocolReplica`), seeded randomness."""
    pool = ReplicaPool(
        urls,
        lambda url: ModelServerClient(url, "upstream-token"),
        policy or RoutingPolicy(eject_base_s=0.2),
        clock=clock,
        rng=random.Random(7),
    )
    responses = ResponseCache(cache or InMemoryCache())
    return InferenceGateway(
        db,
        InMemoryCache(),
        pool,
        admission=Admission(pool, admission, clock=clock),
        responses=responses,
        internal_token=ADMIN_TOKEN,
        request_timeout_s=request_timeout_s,
        clock=clock,
        **kwargs,
    )


@asynccontextmanager
async def http_client(gateway: InferenceGateway, api_key: str = API_KEY) -> AsyncIterator[httpx.AsyncClient]:
    """The gateway's HTTP API in process, authenticated with ``api_key``."""
    app = make_app("inference_gateway")
    install_gateway_api(app, gateway, ADMIN_TOKEN)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    headers = {"Authorization": f"Bearer {api_key}"}
    async with httpx.AsyncClient(
        transport=transport, base_url="http://gateway", headers=headers, timeout=15
    ) as client:
        yield client


@pytest.fixture
async def make_gateway(
    db: Database, api_key: str
) -> AsyncIterator[Callable[..., Awaitable[InferenceGateway]]]:
    """``await make_gateway([urls], policy=..., ...)``: :func:`build_gateway` over the test database,
    with the bootstrap tenant keyed ``api_key``; stopped after the test."""
    built: list[InferenceGateway] = []

    async def make(urls: list[str], **kwargs: Any) -> InferenceGateway:
        gateway = build_gateway(db, urls, **kwargs)
        await gateway.tenants.bootstrap(api_key)
        built.append(gateway)
        return gateway

    yield make
    for gateway in built:
        await gateway.replicas.stop()


@pytest.fixture
def client_for() -> Callable[..., Any]:
    """``async with client_for(gateway[, api_key]) as client``: see :func:`http_client`."""
    return http_client


@pytest.fixture
def admin_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_TOKEN}"}
