"""The request-body limit of :class:`forge_kit.http.HttpServer`, on a real uvicorn server."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI, Request

from forge_kit.http import HttpServer, make_app
from forge_kit.openai_errors import install_openai_error_handlers

LIMIT = 64 * 1024

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]


def _echo_app(openai: bool) -> FastAPI:
    app = make_app("limits")

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"received": len(await request.body())}

    if openai:
        install_openai_error_handlers(app)
    return app


async def _served(openai: bool) -> AsyncIterator[str]:
    server = HttpServer(_echo_app(openai), "127.0.0.1", 0, max_body_bytes=LIMIT)
    await server.start()
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        await server.stop()


@pytest.fixture
async def kit_url() -> AsyncIterator[str]:
    async for url in _served(openai=False):
        yield url


@pytest.fixture
async def openai_url() -> AsyncIterator[str]:
    async for url in _served(openai=True):
        yield url


async def _chunks(size: int) -> AsyncIterator[bytes]:
    for start in range(0, size, 4096):
        yield b"x" * min(4096, size - start)


async def test_bodies_up_to_the_limit_reach_the_app_whole(kit_url: str) -> None:
    async with httpx.AsyncClient(base_url=kit_url) as client:
        assert (await client.post("/echo", content=b"x" * LIMIT)).json() == {"received": LIMIT}
        # Chunked (no Content-Length): read, counted and replayed to the app unchanged.
        reply = await client.post("/echo", content=_chunks(LIMIT))
        assert reply.json() == {"received": LIMIT}
        assert (await client.post("/echo")).json() == {"received": 0}


async def test_a_body_past_the_limit_is_413_in_the_kit_format(kit_url: str) -> None:
    async with httpx.AsyncClient(base_url=kit_url) as client:
        for content in (b"x" * (LIMIT + 1), _chunks(LIMIT + 1), _chunks(50 * LIMIT)):
            reply = await client.post("/echo", content=content)
            assert reply.status_code == 413
            assert reply.json()["error"]["code"] == "request_too_large"
            assert str(LIMIT) in reply.json()["error"]["message"]
        # Not only routed paths: nothing behind the limit sees the body.
        assert (await client.post("/healthz", content=b"x" * (LIMIT + 1))).status_code == 413
        assert (await client.get("/healthz")).status_code == 200


async def test_an_openai_app_gets_the_413_in_the_openai_format(openai_url: str) -> None:
    async with httpx.AsyncClient(base_url=openai_url) as client:
        reply = await client.post("/echo", content=_chunks(2 * LIMIT))
    assert reply.status_code == 413
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
