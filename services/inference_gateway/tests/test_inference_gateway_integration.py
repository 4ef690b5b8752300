"""The gateway against a real model_server process, and promotions through the real broker."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
from forge.common.v1 import common_pb2
from forge.events.v1 import events_pb2

from forge_inference_gateway.openai_api import install_gateway_api
from forge_inference_gateway.replicas.pool import ReplicaPool
from forge_inference_gateway.replicas.upstream import ModelServerClient
from forge_inference_gateway.service import InferenceGateway
from forge_kit.cache import InMemoryCache
from forge_kit.db import Database
from forge_kit.events import KafkaPublisher, ensure_topics
from forge_kit.http import make_app
from forge_kit.testing import ServiceProcess, TansuBroker, base_env, eventkeys

pytestmark = pytest.mark.integration
MODEL_SERVER_TOKEN = "ms-token"
GATEWAY_TOKEN = "gw-token"
TENANT_KEY = "integration-key"
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def model_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    """A real model_server process serving a directory with one model that has no weights."""
    root = tmp_path_factory.mktemp("model-server")
    (root / "models" / "tiny").mkdir(parents=True)
    (root / "models" / "tiny" / "config.json").write_text(
        json.dumps({"model_type": "llama", "max_position_embeddings": 64})
    )
    env = base_env("model_server", token=MODEL_SERVER_TOKEN, models_dir=str(root / "models"))
    proc = ServiceProcess("forge_model_server", env=env, cwd=str(root), log_path=str(root / "log")).start(30)
    yield proc
    proc.stop()


@asynccontextmanager
async def gateway_in_front_of(
    model_server: ServiceProcess, db: Database, upstream_token: str
) -> AsyncIterator[httpx.AsyncClient]:
    """The gateway app in process, calling the model_server process with ``upstream_token``."""
    pool = ReplicaPool([model_server.http_url], lambda url: ModelServerClient(url, upstream_token))
    gateway = InferenceGateway(db, InMemoryCache(), pool, request_timeout_s=10)
    await gateway.tenants.bootstrap(TENANT_KEY)
    app = make_app("inference_gateway")
    install_gateway_api(app, gateway, GATEWAY_TOKEN)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    headers = {"Authorization": f"Bearer {TENANT_KEY}"}
    try:
        async with httpx.AsyncClient(
            transport=transport, base_url="http://gateway", headers=headers
        ) as client:
            yield client
    finally:
        await pool.close()


@pytest.fixture
async def real_http(model_server: ServiceProcess, db: Database) -> AsyncIterator[httpx.AsyncClient]:
    async with gateway_in_front_of(model_server, db, MODEL_SERVER_TOKEN) as client:
        yield client


async def test_models_through_the_gateway_are_the_upstreams(real_http: httpx.AsyncClient) -> None:
    reply = await real_http.get("/v1/models")
    assert reply.status_code == 200
    assert [(m["id"], m["max_model_len"]) for m in reply.json()["data"]] == [("tiny", 64)]


async def test_model_without_weights_returns_the_upstreams_404(real_http: httpx.AsyncClient) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    for request in (body, {**body, "stream": True}):
        reply = await real_http.post(CHAT, json=request)
        assert reply.status_code == 404
        error = reply.json()["error"]
        assert error["code"] == "model_not_found" and error["message"].startswith(
            "no model loaded: tiny: no weights"
        )


async def test_upstream_refusing_the_gateways_token_is_502_not_401(
    model_server: ServiceProcess, db: Database
) -> None:
    async with gateway_in_front_of(model_server, db, "wrong-token") as client:
        models = await client.get("/v1/models")
        chat = await client.post(
            CHAT, json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        )
    for reply in (models, chat):
        assert reply.status_code == 502, reply.text
        assert "rejected the gateway's credentials" in reply.json()["error"]["message"]


def test_promotion_event_updates_the_alias_of_a_running_gateway(
    model_server: ServiceProcess, tmp_path: Path
) -> None:
    """A broker of its own: the session's shared one also carries the eval tests' promotions and
    canaries of other versions of ``tiny``, on other partitions, so in no fixed order with ours."""
    broker = TansuBroker(log_path=str(tmp_path / "broker.log")).start()
    asyncio.run(ensure_topics(broker.bootstrap))
    env = base_env(
        "inference_gateway",
        token=GATEWAY_TOKEN,
        data_dir=tmp_path / "data",
        kafka=broker.bootstrap,
        model_server_url=model_server.http_url,
        model_server_token=MODEL_SERVER_TOKEN,
        bootstrap_api_key=TENANT_KEY,
    )
    gateway = ServiceProcess(
        "forge_inference_gateway", env=env, cwd=str(tmp_path), log_path=str(tmp_path / "log")
    )
    gateway.start(30)
    try:
        event = events_pb2.ModelPromoted(
            model=common_pb2.ModelRef(name="tiny"),
            stage="production",
            traffic_percent=100,
            reason="gate passed",
        )

        async def publish() -> None:
            publisher = KafkaPublisher(broker.bootstrap, signer=eventkeys.signer("eval"))
            try:
                await publisher.publish(event, key="production")
            finally:
                await publisher.close()

        asyncio.run(publish())
        admin = {"Authorization": f"Bearer {GATEWAY_TOKEN}"}
        with httpx.Client(base_url=gateway.http_url, timeout=30) as client:
            assert client.get("/admin/v1/aliases").status_code == 401
            deadline = time.monotonic() + 30
            aliases: dict[str, object] = {}
            while time.monotonic() < deadline and "production" not in aliases:
                listed = client.get("/admin/v1/aliases", headers=admin).json()["aliases"]
                aliases = {a["alias"]: a["model"] for a in listed}
                time.sleep(0.2)
            assert aliases["forge-chat"] == {"name": "tiny", "version": ""}
            assert aliases["production"] == {"name": "tiny", "version": ""}
            tenant = {"Authorization": f"Bearer {TENANT_KEY}"}
            models = client.get("/v1/models", headers=tenant).json()["data"]
            assert {m["id"] for m in models} >= {"tiny", "forge-chat", "production"}
            reply = client.post(
                CHAT,
                headers=tenant,
                json={"model": "forge-chat", "messages": [{"role": "user", "content": "hi"}]},
            )
            assert reply.status_code == 404 and "no model loaded: tiny" in reply.json()["error"]["message"]
            assert client.get("/readyz").status_code == 200
    finally:
        gateway.stop()
        broker.stop()
