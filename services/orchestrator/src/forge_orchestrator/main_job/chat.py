"""The ``chat`` step of the platform main job (order 70, after ``serve`` and ``eval``).

The ``serve`` step deployed the trained checkpoint on vLLM; the ``eval`` step saw the
eval-and-promote workflow register it in eval's model registry and promote it (or block it). This
step makes the product name answer from vLLM replicas the scheduler placed:

1. takes the trained folder and the ``serve`` step's deployment (deployed again as
   ``main-job-chat`` when eval-and-promote made that deployment for its release runs and
   undeployed it on blocking the release), and the checkpoint's registry identity (a
   :class:`~forge_kit.modelref.ModelRef`) from ``ctx.results["eval"]["model"]`` (fails clearly
   without them);
2. asks the registry (eval's ``ListModels``) which model holds ``production`` and where its
   checkpoint is;
3. when production is another model (an earlier run's, or an earlier checkpoint of this one that
   the canary kept), it needs replicas too: the deployment its promotion made (``forge up``'s
   promotions roll replicas), else its own (``main-job-production``, vLLM); otherwise
   ``main-job-production`` is undeployed if an earlier run left it;
4. waits until every deployment it needs has a ready replica (in the gateway's pool) and the
   gateway's ``/v1/models`` lists ``forge-chat`` at the version production holds;
5. sends one streaming chat completion to ``forge-chat`` through the gateway and reports the
   streamed text, the version that answered (``x-forge-model``), the time to its first token, the
   token count, and how many requests production's vLLM replica finished meanwhile (its
   ``vllm:request_success_total``), which says that vLLM answered.

The step never imports the CLI or another service, only their contracts (HTTP, gRPC stubs).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
from forge.common.v1 import common_pb2
from forge.eval.v1 import eval_pb2, eval_pb2_grpc
from forge.orchestrator.v1 import orchestrator_pb2

from forge_kit.grpckit import make_channel
from forge_kit.mainjob import Endpoint, MainJobContext
from forge_kit.modelref import ModelRef
from forge_orchestrator.main_job.serve import (
    DEPLOYMENT,
    DeploymentGoneError,
    Deployments,
    Servable,
    describe,
    spec_of,
    trained_export,
)

#: The product name: the gateway's alias of whatever the registry holds in production.
PUBLIC_MODEL = "forge-chat"
#: The deployment of production's model when it is not the trained one.
PRODUCTION_DEPLOYMENT = "main-job-production"
MODEL_HEADER = "x-forge-model"
QUESTION = "Good morrow, what news?"
SHORT_QUESTION = "Speak."
"""For a model whose context is too small for the question in a chat format."""
MAX_TOKENS = 32
WAIT_GATEWAY_S = 60.0
HTTP_S = 60.0
_FINISHED = re.compile(r"^vllm:request_success_total(?:\{[^}]*\})?\s+([0-9.eE+-]+)$", re.MULTILINE)


class ChatStepError(RuntimeError):
    """A part of the chat step failed; the message says which and what the service answered."""


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


async def production_holder(ctx: MainJobContext) -> tuple[ModelRef, str] | None:
    """The model the registry holds in ``production`` and its checkpoint uri (None: no model)."""
    registry = ctx.endpoint("eval")
    async with make_channel(registry.grpc_target, token=registry.token) as channel:
        stub = eval_pb2_grpc.EvalServiceStub(channel)
        request = eval_pb2.ListModelsRequest(stage="production", page=common_pb2.PageRequest(page_size=1))
        try:
            reply = await stub.ListModels(request, timeout=10)
        except grpc.aio.AioRpcError as exc:
            raise ChatStepError(f"asking eval's registry for the production model: {exc.details()}") from None
    if not reply.models:
        return None
    return ModelRef.of(reply.models[0].ref), reply.models[0].uri


async def chat(ctx: MainJobContext) -> dict[str, object]:
    # 1. The trained checkpoint, its deployment and its registry identity.
    trained = trained_export(ctx)
    served_as = (ctx.results.get("serve") or {}).get("deployment")
    if not served_as:
        raise ChatStepError(
            "the trained model has no deployment: the `serve` step's result has none "
            f"(steps that ran: {', '.join(ctx.results) or 'none'})"
        )
    registered = registered_model(ctx)
    if registered != trained.model:
        raise ChatStepError(f"the registry names the trained checkpoint {registered}, not {trained.model}")
    # 2. Production.
    holder = await production_holder(ctx)
    production, not_served = trained.model, ""
    other: Servable | None = None
    if holder is not None and holder[0] != trained.model:
        folder = local_folder(holder[1], ctx.root)
        if folder is None:
            not_served = f"production {holder[0]} ({holder[1]}: not a folder on this machine)"
        else:
            production = holder[0]
            other = Servable(production, folder, "production")
    orchestrator, gateway = ctx.endpoint("orchestrator"), ctx.endpoint("inference_gateway")
    async with Deployments(orchestrator.grpc_target, orchestrator.token) as deployments:
        # The trained model's deployment; gone when eval-and-promote made it for its release
        # runs and undeployed it on blocking the release: the trained model is deployed again.
        if await deployments.get(str(served_as)) is None:
            served_as = DEPLOYMENT
            await deployments.ensure(spec_of(DEPLOYMENT, trained))
        needed = [str(served_as)]
        # 3. Production's deployment: the one a promotion made, else its own, else none.
        made = await deployments.serving(production) if other is not None else None
        if other is not None and made is None:
            await deployments.ensure(spec_of(PRODUCTION_DEPLOYMENT, other))
            needed.append(PRODUCTION_DEPLOYMENT)
        else:
            await deployments.remove(PRODUCTION_DEPLOYMENT)
            if made is not None:
                needed.append(made.spec.name)
        # 4. Ready replicas, and forge-chat at production's version in the gateway.
        started = time.monotonic()
        ready = await asyncio.gather(
            _ready_or_own(deployments, str(served_as), trained),
            *(deployments.wait_ready(name) for name in dict.fromkeys(needed[1:]) if name != served_as),
        )
        waited_ready = time.monotonic() - started
    serving = ready[-1]
    replica = next(r for r in serving.replicas if r.state == "ready")
    alias = PUBLIC_MODEL if holder is not None and not not_served else str(trained.model)
    async with httpx.AsyncClient(timeout=HTTP_S) as client:
        card, waited_gateway = await _wait_listed(client, gateway, alias, production)
        context = card.get("max_model_len")
        # A model with a tiny context: leave max_tokens out and the server answers with what room
        # the prompt leaves (vLLM's rule), instead of a 400.
        small = isinstance(context, int) and 0 < context < 4 * MAX_TOKENS
        max_tokens, question = (None, SHORT_QUESTION) if small else (MAX_TOKENS, QUESTION)
        # 5. One streamed chat completion through the gateway, to the product name.
        before = await _finished(client, replica.endpoint)
        streamed = await stream_chat(client, gateway, alias, question, max_tokens)
        after = await _finished(client, replica.endpoint)
    return {
        "ok": streamed["completion_tokens"] > 0
        and streamed["finish_reason"] is not None
        and streamed["served_by"] == str(production),
        "model": alias,
        "served_model": alias,
        "trained_model": str(trained.model),
        "production": str(production),
        "deployments": [describe(d) for d in ready],
        "not_served": not_served,
        "checkpoint": str(trained.path),
        "waited_for_replicas_s": round(waited_ready, 1),
        "gateway_saw_model_after_s": round(waited_gateway, 2),
        "vllm_requests_finished": after - before if before is not None and after is not None else None,
        "question": question,
        **streamed,
    }


chat.order = 70  # type: ignore[attr-defined]
chat.timeout_s = 600.0  # type: ignore[attr-defined]


async def _ready_or_own(
    deployments: Deployments, name: str, trained: Servable
) -> orchestrator_pb2.Deployment:
    """``name`` once a replica is ready; if it goes away meanwhile (a promotion-made deployment
    of a canary that was rolled back is drained as the loser), the trained model's own
    deployment instead."""
    try:
        return await deployments.wait_ready(name)
    except DeploymentGoneError:
        if name == DEPLOYMENT:
            raise
        await deployments.ensure(spec_of(DEPLOYMENT, trained))
        return await deployments.wait_ready(DEPLOYMENT)


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _expect(reply: httpx.Response, statuses: set[int], doing: str) -> None:
    if reply.status_code not in statuses:
        raise ChatStepError(f"{doing}: HTTP {reply.status_code}: {reply.text[:500]}")


async def _finished(client: httpx.AsyncClient, replica_url: str) -> int | None:
    """Requests the vLLM replica at ``replica_url`` has finished (its ``/metrics``); None when it
    does not say."""
    try:
        reply = await client.get(f"{replica_url}/metrics")
    except httpx.HTTPError:
        return None
    values = _FINISHED.findall(reply.text) if reply.status_code == 200 else []
    return int(sum(float(v) for v in values)) if values else None


async def _wait_listed(
    client: httpx.AsyncClient, gateway: Endpoint, model: str, version_of: ModelRef
) -> tuple[dict[str, Any], float]:
    """Wait until the gateway's ``/v1/models`` lists ``model`` (an alias, moved there by
    ``ModelPromoted``, or a model) at the version of ``version_of``; its card and seconds waited."""
    started = time.monotonic()
    while True:
        reply = await client.get(f"{gateway.http_url}/v1/models", headers=_bearer(gateway.token))
        if reply.status_code == 200:
            for card in reply.json().get("data", []):
                if card.get("id") == model and str(card.get("version") or "") == version_of.version:
                    return card, time.monotonic() - started
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
    usage reports. ``max_tokens`` None: as many as the model's context leaves after the prompt."""
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
                if "role" in delta and not delta.get("content"):
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
