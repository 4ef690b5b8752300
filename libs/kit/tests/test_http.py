"""make_app probes, error mapping and require_token, through httpx's ASGI transport."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio
from fastapi import Depends
from pydantic import BaseModel

from forge_kit import errors
from forge_kit.http import HttpServer, make_app, require_token


class Body(BaseModel):
    team: str
    gpus: int


def build(ready: dict[str, bool], raising: bool = False) -> httpx.AsyncClient:
    async def database() -> bool:
        return ready["database"]

    async def broken() -> bool:
        raise ConnectionError("redis down")

    checks = {"database": database}
    if raising:
        checks["redis"] = broken
    app = make_app("test", readiness=checks)

    @app.get("/invalid")
    async def invalid() -> None:
        raise errors.ValidationError("spec.team", "must not be empty")

    @app.get("/busy")
    async def busy() -> None:
        raise errors.OverloadedError("queue full", retry_after_s=1.2)

    @app.get("/unanswered")
    async def unanswered() -> None:
        raise errors.UnavailableError("Temporal did not answer; retry", retry_after_s=2.0)

    @app.get("/missing")
    async def missing() -> None:
        raise errors.NotFoundError("job j-1 not found")

    @app.get("/conflict")
    async def conflict() -> None:
        raise errors.ConflictError("job already finished")

    @app.get("/bug")
    async def bug() -> None:
        raise RuntimeError("password=hunter2")

    @app.post("/jobs")
    async def jobs(body: Body) -> dict[str, int]:
        return {"gpus": body.gpus}

    @app.get("/secret", dependencies=[Depends(require_token("s3cret"))])
    async def secret() -> dict[str, bool]:
        return {"ok": True}

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://test")


@pytest_asyncio.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with build({"database": True}) as c:
        yield c


@pytest.mark.asyncio
async def test_probes(client: httpx.AsyncClient) -> None:
    health = await client.get("/healthz")
    assert health.status_code == 200
    assert health.json()["service"] == "test"
    ready = await client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json() == {"ready": True, "checks": {"database": True}}
    metrics = await client.get("/metrics")
    assert metrics.status_code == 200
    assert "python_info" in metrics.text or "process_" in metrics.text or "# HELP" in metrics.text


@pytest.mark.asyncio
async def test_readyz_is_503_when_a_check_fails_or_raises() -> None:
    state = {"database": True}
    async with build(state) as client:
        assert (await client.get("/readyz")).status_code == 200
        state["database"] = False
        reply = await client.get("/readyz")
        assert reply.status_code == 503
        assert reply.json()["checks"] == {"database": False}
    async with build({"database": True}, raising=True) as client:
        reply = await client.get("/readyz")
        assert reply.status_code == 503
        assert reply.json()["checks"] == {"database": True, "redis": False}


@pytest.mark.asyncio
async def test_domain_errors_become_json_statuses(client: httpx.AsyncClient) -> None:
    invalid = await client.get("/invalid")
    assert invalid.status_code == 400
    assert invalid.json()["error"]["field"] == "spec.team"
    assert "must not be empty" in invalid.json()["error"]["message"]
    busy = await client.get("/busy")
    assert busy.status_code == 429
    assert busy.headers["Retry-After"] == "2"
    assert (await client.get("/missing")).status_code == 404
    assert (await client.get("/conflict")).status_code == 409
    unanswered = await client.get("/unanswered")
    assert unanswered.status_code == 503 and unanswered.headers["Retry-After"] == "2"
    assert unanswered.json()["error"]["code"] == "unavailable"


@pytest.mark.asyncio
async def test_bad_body_is_422_naming_the_field(client: httpx.AsyncClient) -> None:
    reply = await client.post("/jobs", json={"team": "a", "gpus": "many"})
    assert reply.status_code == 422
    assert reply.json()["error"]["field"] == "gpus"


@pytest.mark.asyncio
async def test_unexpected_errors_are_500_without_details(client: httpx.AsyncClient) -> None:
    reply = await client.get("/bug")
    assert reply.status_code == 500
    assert "hunter2" not in reply.text


@pytest.mark.asyncio
async def test_require_token(client: httpx.AsyncClient) -> None:
    assert (await client.get("/secret")).status_code == 401
    wrong = await client.get("/secret", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    assert wrong.headers["WWW-Authenticate"] == "Bearer"
    ok = await client.get("/secret", headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200


@pytest.mark.integration
@pytest.mark.asyncio
async def test_http_server_binds_a_free_port_and_stops() -> None:
    server = HttpServer(make_app("test"), "127.0.0.1", 0)
    await server.start()
    assert server.port > 0
    async with httpx.AsyncClient() as client:
        assert (await client.get(f"http://127.0.0.1:{server.port}/healthz")).status_code == 200
    await server.stop()
    async with httpx.AsyncClient() as client:
        with pytest.raises(httpx.ConnectError):
            await client.get(f"http://127.0.0.1:{server.port}/healthz")
