from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest
from forge.common.v1 import common_pb2
from forge.events.v1 import events_pb2

from forge_inference_gateway.openai_api import install_gateway_api
from forge_inference_gateway.service import InferenceGateway
from forge_inference_gateway.upstream import ModelServerClient
from forge_kit.cache import InMemoryCache
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
async def db(tmp_path: Path) -> AsyncIterator[Database]:
    database = Database(f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}")
    await database.migrate(MIGRATIONS)
    yield database
    await database.dispose()


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
def upstream_transport() -> httpx.AsyncBaseTransport | None:
    """None: real network. Overridden where a test replays recorded upstream answers."""
    return None


@pytest.fixture
async def gateway(
    db: Database, clock: FakeClock, upstream_url: str, upstream_transport: httpx.AsyncBaseTransport | None
) -> AsyncIterator[InferenceGateway]:
    upstream = ModelServerClient(upstream_url, "upstream-token", transport=upstream_transport)
    service = InferenceGateway(
        db,
        InMemoryCache(clock=clock),
        upstream,
        default_rpm_limit=5,
        request_timeout_s=10,
        internal_token=ADMIN_TOKEN,
    )
    await service.bootstrap(API_KEY)
    yield service
    await upstream.close()


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


class RecordedUpstream:
    """Replays recorded model-server answers and keeps the requests the gateway sent."""

    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []
        self.sse = RECORDED_SSE

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        body = json.loads(request.content)
        if body["model"] != "tiny":
            error = {
                "message": f"The model `{body['model']}` does not exist.",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
            return httpx.Response(404, json={"error": error})
        if body.get("stream"):
            return httpx.Response(200, content=RECORDED_SSE, headers={"content-type": "text/event-stream"})
        return httpx.Response(500, text="Traceback (most recent call last): ...")


@pytest.fixture
def recorded() -> RecordedUpstream:
    """Recorded model-server answers; a module opts in by overriding ``upstream_transport``."""
    return RecordedUpstream()
