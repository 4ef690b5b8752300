"""The ``chat`` step of the platform main job (entry-point group ``forge.main_job``).

After the ``train`` step has exported a checkpoint in Hugging Face format, this step:

1. takes that folder from ``ctx.results["train"]["checkpoint_uri"]`` (fails clearly without it);
2. loads it into the platform's model server as ``forge-main-job`` (``POST /admin/v1/models``);
3. makes sure the gateway routes to that model server (``POST /admin/v1/replicas``; already
   there is fine) and waits until the gateway's view of the replica lists the model;
4. sends one streaming chat completion through the gateway (``/v1/chat/completions``) and
   reports the streamed text, the time to its first token and the token count.

The step never imports the CLI or another service, only their HTTP contracts.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import httpx

MODEL = "forge-main-job"
QUESTION = "Good morrow, what news?"
SHORT_QUESTION = "Speak."
"""For a model whose context is too small for the question in a chat format (the main job's)."""
MAX_TOKENS = 32
WAIT_GATEWAY_S = 45.0
HTTP_S = 60.0


class Endpoint(Protocol):
    @property
    def http_url(self) -> str: ...

    @property
    def token(self) -> str: ...


class MainJobContext(Protocol):
    """The part of ``forge_cli.mainjob.MainJobContext`` this step uses."""

    @property
    def root(self) -> Path: ...

    @property
    def results(self) -> Mapping[str, Mapping[str, Any]]: ...

    def endpoint(self, name: str) -> Endpoint: ...


class ChatStepError(RuntimeError):
    """A part of the chat step failed; the message says which and what the service answered."""


def trained_checkpoint(ctx: MainJobContext) -> tuple[Path, str]:
    """The Hugging Face folder the ``train`` step exported (absolute) and a version for it."""
    train = ctx.results.get("train") or {}
    uri = train.get("checkpoint_uri")
    if not uri:
        raise ChatStepError(
            "no trained checkpoint to serve: the `train` step's result has no checkpoint_uri "
            f"(steps that ran: {', '.join(ctx.results) or 'none'})"
        )
    path = Path(str(uri).removeprefix("file://"))
    # A version per trained checkpoint, so nothing the gateway keyed by version mixes two runs up.
    label = "-".join(str(train[k]) for k in ("run_id", "step") if train.get(k) is not None)
    version = re.sub(r"[^A-Za-z0-9._-]", "-", label)[:64]
    return (path if path.is_absolute() else ctx.root / path), version


async def chat(ctx: MainJobContext) -> dict[str, object]:
    # 1. The checkpoint.
    checkpoint, version = trained_checkpoint(ctx)
    server, gateway = ctx.endpoint("model_server"), ctx.endpoint("inference_gateway")
    async with httpx.AsyncClient(timeout=HTTP_S) as client:
        # 2. Load it into the model server.
        reply = await client.post(
            f"{server.http_url}/admin/v1/models",
            json={"name": MODEL, "path": str(checkpoint), "version": version},
            headers=_bearer(server.token),
        )
        _expect(reply, {201}, f"loading {checkpoint} into the model server")
        # The main job's model has a tiny context (32 tokens): there, leave max_tokens out and the
        # server answers with what room the prompt leaves (vLLM's rule), instead of a 400.
        context = reply.json().get("max_model_len")
        small = bool(context) and context < 4 * MAX_TOKENS
        max_tokens, question = (None, SHORT_QUESTION) if small else (MAX_TOKENS, QUESTION)
        # 3. The gateway routes to that model server and has seen the model there.
        waited = await _register_with_gateway(client, gateway, server.http_url, server.token)
        # 4. One streamed chat completion through the gateway.
        streamed = await stream_chat(client, gateway, MODEL, question, max_tokens)
    return {
        "ok": streamed["completion_tokens"] > 0 and streamed["finish_reason"] is not None,
        "model": f"{MODEL}:{version}" if version else MODEL,
        "served_model": MODEL,
        "checkpoint": str(checkpoint),
        "gateway_saw_model_after_s": round(waited, 2),
        "question": question,
        **streamed,
    }


chat.order = 70  # type: ignore[attr-defined]
chat.timeout_s = 180.0  # type: ignore[attr-defined]


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _expect(reply: httpx.Response, statuses: set[int], doing: str) -> None:
    if reply.status_code not in statuses:
        raise ChatStepError(f"{doing}: HTTP {reply.status_code}: {reply.text[:500]}")


async def _register_with_gateway(
    client: httpx.AsyncClient, gateway: Endpoint, replica_url: str, replica_token: str
) -> float:
    """Add the model server to the gateway's replicas with the token it accepts (409: it is there
    already) and wait until the gateway's scrape of its ``/v1/models`` lists the model; seconds
    waited."""
    admin = f"{gateway.http_url}/admin/v1/replicas"
    reply = await client.post(
        admin, json={"url": replica_url, "token": replica_token}, headers=_bearer(gateway.token)
    )
    _expect(reply, {201, 409}, f"adding {replica_url} to the gateway's replicas")
    started = time.monotonic()
    wanted = replica_url.rstrip("/")
    while True:
        reply = await client.get(admin, headers=_bearer(gateway.token))
        _expect(reply, {200}, "listing the gateway's replicas")
        for replica in reply.json().get("replicas", []):
            if replica.get("url") == wanted and MODEL in (replica.get("models") or []):
                return time.monotonic() - started
        if time.monotonic() - started > WAIT_GATEWAY_S:
            raise ChatStepError(
                f"the gateway did not list {MODEL} on {wanted} within {WAIT_GATEWAY_S:.0f}s "
                f"(its replicas: {reply.text[:500]})"
            )
        await asyncio.sleep(0.5)


async def stream_chat(
    client: httpx.AsyncClient,
    gateway: Endpoint,
    model: str,
    question: str,
    max_tokens: int | None = MAX_TOKENS,
) -> dict[str, Any]:
    """One streamed chat completion: its text, the time to its first token's event, the token
    events received and the completion tokens the usage reports. ``max_tokens`` None: as many as
    the model's context leaves after the prompt."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        # Sampled without a seed: the gateway caches only deterministic requests, and this one
        # should reach the model.
        "temperature": 0.8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    pieces: list[str] = []
    events = 0
    ttft: float | None = None
    usage: dict[str, Any] = {}
    finish = None
    started = time.monotonic()
    url = f"{gateway.http_url}/v1/chat/completions"
    async with client.stream("POST", url, json=body, headers=_bearer(gateway.token)) as reply:
        if reply.status_code != 200:
            await reply.aread()
            _expect(reply, {200}, "the chat completion through the gateway")
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                raise ChatStepError(f"the stream reported an error: {event['error']}")
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                delta = choice.get("delta", {})
                if "role" in delta:
                    continue  # the opening event, before any token
                # The first token's event, even when its text is held back or it is the end token.
                ttft = time.monotonic() - started if ttft is None else ttft
                events += 1
                if delta.get("content"):
                    pieces.append(delta["content"])
                finish = choice.get("finish_reason") or finish
    return {
        "text": "".join(pieces),
        "ttft_ms": round(ttft * 1000, 1) if ttft is not None else None,
        "e2e_ms": round((time.monotonic() - started) * 1000, 1),
        "token_events": events,
        "completion_tokens": int(usage.get("completion_tokens", 0)),
        "finish_reason": finish,
    }
