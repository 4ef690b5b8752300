"""A fault-injecting replica: an OpenAI-compatible front for a real model server that serves one
of its models under another name, with injected errors (``forge bench canary``'s replicas, each
behind one, so every model takes the same extra hop).

* ``error_rate``: that share of generation requests (seeded draws) is answered HTTP 500 at once.

Latency is not injected here (a delay scaled to the model server's own time per chunk was a small
part of what the client waits, and never showed there): ``forge bench canary`` puts a
delaying TCP proxy between the front and the slow candidate's model server instead.

Everything else (``/v1/models`` lists only ``name``; ``/metrics`` and ``/health`` are the model
server's) passes through, so the gateway routes, scrapes and health-checks it like any replica.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


def fault_replica(
    upstream: str,
    *,
    name: str,
    serves: str,
    token: str = "",
    error_rate: float = 0.0,
    seed: int = 0,
) -> FastAPI:
    """The app: requests for ``name`` go to ``upstream``'s model ``serves``, with the faults."""
    if not 0 <= error_rate <= 1:
        raise ValueError("error_rate must be in [0, 1]")
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    client = httpx.AsyncClient(base_url=upstream, headers=headers, timeout=httpx.Timeout(120.0))
    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        reply = await client.get("/health")
        return Response(reply.content, status_code=reply.status_code)

    @app.get("/metrics")
    async def metrics() -> Response:
        reply = await client.get("/metrics")
        return Response(reply.content, status_code=reply.status_code, media_type="text/plain")

    @app.get("/v1/models")
    async def models() -> dict[str, object]:
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "forge"}]}

    async def generate(path: str, request: Request) -> Response:
        body = await request.json()
        if body.get("model") != name:
            return JSONResponse(
                {"error": {"message": f"model {body.get('model')!r} not served"}}, status_code=404
            )
        if rng.random() < error_rate:
            return JSONResponse(
                {"error": {"message": "injected fault", "type": "server_error"}}, status_code=500
            )
        body["model"] = serves
        try:
            if not body.get("stream"):
                whole = await client.post(path, json=body)
                return Response(whole.content, status_code=whole.status_code, media_type="application/json")
            reply = await client.send(client.build_request("POST", path, json=body), stream=True)
        except httpx.HTTPError as exc:
            # The model server itself failed: the replica's failure, as a 502.
            return JSONResponse(
                {"error": {"message": f"model server: {exc!r}", "type": "server_error"}}, status_code=502
            )
        if reply.status_code != 200:
            content = await reply.aread()
            await reply.aclose()
            return Response(content, status_code=reply.status_code, media_type="application/json")

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in reply.aiter_raw():
                    yield chunk
            finally:
                await reply.aclose()

        return StreamingResponse(relay(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await generate("/v1/chat/completions", request)

    return app
