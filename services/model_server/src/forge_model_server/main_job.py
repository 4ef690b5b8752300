"""The ``chat`` step of the platform main job (entry-point group ``forge.main_job``).

After the ``train`` step has exported a checkpoint in Hugging Face format and the ``eval`` step has
seen its eval-and-promote workflow register it in eval's model registry and promote it (or block
it), this step makes the product name answer:

1. takes the trained folder from ``ctx.results["train"]["checkpoint_uri"]`` and its registry
   identity (a :class:`~forge_kit.modelref.ModelRef`) from ``ctx.results["eval"]["model"]``
   (fails clearly without them);
2. asks the registry (eval's ``ListModels``) which models hold the serving stages (``canary``,
   ``production``) and where their checkpoints are;
3. loads each into the platform's model server under its registry name and version
   (``POST /admin/v1/models``): the gateway's aliases, moved by ``ModelPromoted``, name models by
   that identity, so the replica must serve them under it;
4. makes sure the gateway routes to that model server (``POST /admin/v1/replicas``; already
   there is fine) and waits until the gateway's ``/v1/models`` lists ``forge-chat`` at the
   version production holds;
5. sends one streaming chat completion to ``forge-chat`` through the gateway and reports the
   streamed text, the version that answered (``x-forge-model``), the time to its first token
   and the token count.

The step never imports the CLI or another service, only their contracts (HTTP, eval's gRPC stubs).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
from forge.common.v1 import common_pb2
from forge.eval.v1 import eval_pb2, eval_pb2_grpc

from forge_kit.grpckit import make_channel
from forge_kit.mainjob import Endpoint, MainJobContext
from forge_kit.modelref import ModelRef

#: The product name: the gateway's alias of whatever the registry holds in production.
PUBLIC_MODEL = "forge-chat"
#: The registry's serving stages, loaded in this order (a later one wins a name they share).
STAGES = ("canary", "production")
MODEL_HEADER = "x-forge-model"
QUESTION = "Good morrow, what news?"
SHORT_QUESTION = "Speak."
"""For a model whose context is too small for the question in a chat format (the main job's)."""
MAX_TOKENS = 32
WAIT_GATEWAY_S = 45.0
HTTP_S = 60.0


class ChatStepError(RuntimeError):
    """A part of the chat step failed; the message says which and what the service answered."""


@dataclass(frozen=True)
class Servable:
    """A checkpoint folder on this machine and the registry identity it is served under."""

    model: ModelRef
    path: Path
    why: str
    """``trained``, or the registry stage it holds."""


def trained_checkpoint(ctx: MainJobContext) -> Path:
    """The Hugging Face folder the ``train`` step exported (absolute)."""
    train = ctx.results.get("train") or {}
    uri = train.get("checkpoint_uri")
    if not uri:
        raise ChatStepError(
            "no trained checkpoint to serve: the `train` step's result has no checkpoint_uri "
            f"(steps that ran: {', '.join(ctx.results) or 'none'})"
        )
    path = Path(str(uri).removeprefix("file://"))
    return path if path.is_absolute() else ctx.root / path


def registered_model(ctx: MainJobContext) -> ModelRef:
    """The trained checkpoint's identity in eval's registry, as the ``eval`` step reports it."""
    reported = (ctx.results.get("eval") or {}).get("model")
    if not isinstance(reported, str) or not reported:
        raise ChatStepError(
            "the trained checkpoint's registry identity is unknown: the `eval` step's result has no "
            f"model (steps that ran: {', '.join(ctx.results) or 'none'}); the model is served under "
            "the name the registry gives it, so that the gateway's aliases route to it"
        )
    try:
        return ModelRef.parse(reported)
    except ValueError as exc:
        raise ChatStepError(f"the `eval` step reported an invalid model: {exc}") from None


def local_folder(uri: str, root: Path) -> Path | None:
    """The checkpoint folder ``uri`` names on this machine (a path or ``file://`` URL), or None."""
    if "://" in uri and not uri.startswith("file://"):
        return None
    path = Path(uri.removeprefix("file://"))
    path = path if path.is_absolute() else root / path
    return path if (path / "config.json").is_file() else None


async def stage_holders(ctx: MainJobContext) -> dict[str, tuple[ModelRef, str]]:
    """Per serving stage, the model the registry says holds it and its checkpoint uri."""
    registry = ctx.endpoint("eval")
    holders: dict[str, tuple[ModelRef, str]] = {}
    async with make_channel(registry.grpc_target, token=registry.token) as channel:
        stub = eval_pb2_grpc.EvalServiceStub(channel)
        for stage in STAGES:
            request = eval_pb2.ListModelsRequest(stage=stage, page=common_pb2.PageRequest(page_size=1))
            try:
                reply = await stub.ListModels(request, timeout=10)
            except grpc.aio.AioRpcError as exc:
                raise ChatStepError(
                    f"asking eval's registry for the {stage} model: {exc.details()}"
                ) from None
            if reply.models:
                holders[stage] = (ModelRef.of(reply.models[0].ref), reply.models[0].uri)
    return holders


async def chat(ctx: MainJobContext) -> dict[str, object]:
    # 1. The checkpoint and its registry identity.
    trained = Servable(registered_model(ctx), trained_checkpoint(ctx), "trained")
    # 2. What the registry serves.
    holders = await stage_holders(ctx)
    servables = {trained.model: trained}
    skipped = []
    for stage, (model, uri) in holders.items():
        folder = trained.path if model == trained.model else local_folder(uri, ctx.root)
        if folder is None:
            skipped.append(f"{stage} {model} ({uri}: not a folder on this machine)")
            continue
        servables[model] = Servable(model, folder, stage)
    production = holders.get("production", (trained.model, ""))[0]
    server, gateway = ctx.endpoint("model_server"), ctx.endpoint("inference_gateway")
    async with httpx.AsyncClient(timeout=HTTP_S) as client:
        # 3. Each under its registry name and version.
        contexts = {}
        for item in servables.values():
            contexts[item.model] = await _load(client, server, item)
        # The main job's model has a tiny context (32 tokens): there, leave max_tokens out and the
        # server answers with what room the prompt leaves (vLLM's rule), instead of a 400.
        context = contexts.get(production) or 0
        small = 0 < context < 4 * MAX_TOKENS
        max_tokens, question = (None, SHORT_QUESTION) if small else (MAX_TOKENS, QUESTION)
        # 4. The gateway routes to that model server and lists forge-chat at production's version.
        alias = PUBLIC_MODEL if "production" in holders else str(trained.model)
        waited = await _register_with_gateway(
            client, gateway, server.http_url, server.token, alias, production
        )
        # 5. One streamed chat completion through the gateway, to the product name.
        streamed = await stream_chat(client, gateway, alias, question, max_tokens)
    return {
        "ok": streamed["completion_tokens"] > 0
        and streamed["finish_reason"] is not None
        and streamed["served_by"] == str(production),
        "model": alias,
        "served_model": alias,
        "trained_model": str(trained.model),
        "production": str(production),
        "served": sorted(f"{m} ({s.why})" for m, s in servables.items()),
        "not_served": skipped,
        "checkpoint": str(trained.path),
        "gateway_saw_model_after_s": round(waited, 2),
        "question": question,
        **streamed,
    }


chat.order = 70  # type: ignore[attr-defined]
chat.timeout_s = 180.0  # type: ignore[attr-defined]


async def _load(client: httpx.AsyncClient, server: Endpoint, item: Servable) -> int | None:
    """Serve ``item`` on the model server under its registry identity; its context length."""
    reply = await client.post(
        f"{server.http_url}/admin/v1/models",
        json={"name": item.model.name, "path": str(item.path), "version": item.model.version},
        headers=_bearer(server.token),
    )
    _expect(reply, {201}, f"loading {item.path} into the model server as {item.model}")
    context = reply.json().get("max_model_len")
    return context if isinstance(context, int) else None


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _expect(reply: httpx.Response, statuses: set[int], doing: str) -> None:
    if reply.status_code not in statuses:
        raise ChatStepError(f"{doing}: HTTP {reply.status_code}: {reply.text[:500]}")


async def _register_with_gateway(
    client: httpx.AsyncClient,
    gateway: Endpoint,
    replica_url: str,
    replica_token: str,
    model: str,
    version_of: ModelRef,
) -> float:
    """Add the model server to the gateway's replicas with the token it accepts (409: it is there
    already) and wait until the gateway's ``/v1/models`` lists ``model`` (an alias, moved there by
    ``ModelPromoted``, or a model) at the version of ``version_of``; seconds waited."""
    admin = f"{gateway.http_url}/admin/v1/replicas"
    reply = await client.post(
        admin, json={"url": replica_url, "token": replica_token}, headers=_bearer(gateway.token)
    )
    _expect(reply, {201, 409}, f"adding {replica_url} to the gateway's replicas")
    started = time.monotonic()
    while True:
        reply = await client.get(f"{gateway.http_url}/v1/models", headers=_bearer(gateway.token))
        if reply.status_code == 200:
            listed = {str(m.get("id")): str(m.get("version") or "") for m in reply.json().get("data", [])}
            if listed.get(model) == version_of.version:
                return time.monotonic() - started
        if time.monotonic() - started > WAIT_GATEWAY_S:
            raise ChatStepError(
                f"the gateway did not list {model} at {version_of} within {WAIT_GATEWAY_S:.0f}s "
                f"(its /v1/models: HTTP {reply.status_code} {reply.text[:500]})"
            )
        await asyncio.sleep(0.5)


async def stream_chat(
    client: httpx.AsyncClient,
    gateway: Endpoint,
    model: str,
    question: str,
    max_tokens: int | None = MAX_TOKENS,
) -> dict[str, Any]:
    """One streamed chat completion: the model version that answered (``x-forge-model``), its text,
    the time to its first token's event, the token events received and the completion tokens the
    usage reports. ``max_tokens`` None: as many as
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
            _expect(reply, {200}, f"the chat completion with {model} through the gateway")
        served_by = reply.headers.get(MODEL_HEADER, "")
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
        "served_by": served_by,
        "text": "".join(pieces),
        "ttft_ms": round(ttft * 1000, 1) if ttft is not None else None,
        "e2e_ms": round((time.monotonic() - started) * 1000, 1),
        "token_events": events,
        "completion_tokens": int(usage.get("completion_tokens", 0)),
        "finish_reason": finish,
    }
