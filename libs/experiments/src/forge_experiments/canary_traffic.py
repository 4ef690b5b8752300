"""Traffic for a guarded canary in the platform's main job, and its decision in a few figures.

A guarded canary decides on the gateway's counts of the canary's and production's requests; in
the main job nobody else chats, so the steps that hand a model to eval-and-promote (``eval``,
``rlhf``) run :func:`serve_and_drive` beside their wait:

1. poll eval's registry until a model holds ``canary`` while another holds ``production``;
2. make sure the gateway answers both by ``name:version`` (a one-token completion each; direct
   requests, outside the split the analysis counts): where promotions roll replicas
   (``forge up``), each version's deployment already serves it (eval-and-promote makes the
   candidate's replicas ready before the split names it), so nothing is started here. Only a
   platform whose promotions deploy nothing (``model_server`` given, and a version the gateway
   does not answer at once) has both loaded, under their registry name and version, into its
   model server (``POST /admin/v1/models``; already loaded is fine) when their checkpoints are
   folders on this machine, routed by the gateway (``POST /admin/v1/replicas``); with no model
   server, the gateway is given ``SERVED_WAIT_S`` to answer both;
3. chat with the production alias through the gateway with the ``openai`` SDK, a new ``user``
   per request (the gateway's split is sticky per user, so about the canary's share of users
   reach it), ``concurrency`` at a time and at most ``rate_per_s`` a second (under the gateway
   tenant's per-minute limit), until the registry no longer holds that model in
   ``canary`` (the analysis decided), ``stop`` is set or ``max_requests`` were sent.

:func:`main_job_traffic` starts it for a main-job step. :func:`canary_summary` turns an eval-and-promote result's ``canary`` entry (its decision and the
analysis' evidence) into the line and figures a step's table prints.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
from forge.common.v1 import common_pb2
from forge.eval.v1 import eval_pb2, eval_pb2_grpc

from forge_kit.grpckit import make_channel
from forge_kit.mainjob import MainJobContext
from forge_kit.modelref import ModelRef

MODEL_HEADER = "x-forge-model"
QUESTION = "Speak."
#: Models whose context is smaller than this get no ``max_tokens`` (the server fills what room the
#: prompt leaves); larger ones answer in :data:`MAX_TOKENS`.
SMALL_CONTEXT = 128
MAX_TOKENS = 16
HTTP_S = 60.0
#: How long step 2 waits for the gateway to answer both versions when there is no model server
#: to load them into.
SERVED_WAIT_S = 20.0


@dataclass(frozen=True)
class Http:
    """A service's HTTP address and the bearer token it accepts."""

    url: str
    token: str


@dataclass
class TrafficReport:
    """What :func:`serve_and_drive` did."""

    canary: str = ""
    production: str = ""
    served: list[str] = field(default_factory=list)
    """Models loaded into the model server for the canary (``name:version``); empty when the
    gateway answered both from their deployments' replicas."""
    sent: int = 0
    answered_by: dict[str, int] = field(default_factory=dict)
    """Answers per model version (the gateway's ``x-forge-model``)."""
    failed: dict[str, int] = field(default_factory=dict)
    """Requests that failed, by HTTP status (or the error's class)."""
    seconds: float = 0.0
    note: str = ""
    first_error: str = ""

    def as_dict(self) -> dict[str, object]:
        return {
            "canary": self.canary,
            "production": self.production,
            "served_by": "the model server" if self.served else "the versions' deployments",
            "sent": self.sent,
            "answered_by": dict(self.answered_by),
            "failed": dict(self.failed),
            "seconds": round(self.seconds, 1),
            **({"note": self.note} if self.note else {}),
            **({"first_error": self.first_error} if self.first_error else {}),
        }


async def _holder(stub: eval_pb2_grpc.EvalServiceAsyncStub, stage: str) -> eval_pb2.RegisteredModel | None:
    reply = await stub.ListModels(
        eval_pb2.ListModelsRequest(stage=stage, page=common_pb2.PageRequest(page_size=1)), timeout=10
    )
    return reply.models[0] if reply.models else None


def _folder(uri: str, root: Path) -> Path | None:
    if "://" in uri and not uri.startswith("file://"):
        return None
    path = Path(uri.removeprefix("file://"))
    path = path if path.is_absolute() else root / path
    return path if (path / "config.json").is_file() else None


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def _answers(http: httpx.AsyncClient, gateway: Http, ref: ModelRef) -> bool:
    """Whether the gateway answers a one-token completion of ``ref`` (``name:version``) from it."""
    try:
        reply = await http.post(
            f"{gateway.url}/v1/completions",
            json={"model": str(ref), "prompt": QUESTION, "max_tokens": 1},
            headers=_bearer(gateway.token),
        )
    except httpx.HTTPError:
        return False
    return reply.status_code == 200 and reply.headers.get(MODEL_HEADER, "") == str(ref)


async def _answered(
    http: httpx.AsyncClient,
    gateway: Http,
    models: list[eval_pb2.RegisteredModel],
    wait_s: float,
    stop: asyncio.Event,
) -> bool:
    """Step 2: whether the gateway answers every one of ``models``, waiting up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        if all([await _answers(http, gateway, ModelRef.of(m.ref)) for m in models]):
            return True
        if stop.is_set() or time.monotonic() >= deadline:
            return False
        await asyncio.sleep(1.0)


async def _context(http: httpx.AsyncClient, gateway: Http, models: list[eval_pb2.RegisteredModel]) -> int:
    """The smallest context the gateway's cards of ``models`` declare (0: unknown)."""
    names = {n for m in models for n in (m.ref.name, str(ModelRef.of(m.ref)))}
    reply = await http.get(f"{gateway.url}/v1/models", headers=_bearer(gateway.token))
    cards = reply.json().get("data", []) if reply.status_code == 200 else []
    lengths = [
        c["max_model_len"]
        for c in cards
        if isinstance(c, dict) and c.get("id") in names and isinstance(c.get("max_model_len"), int)
    ]
    return min((n for n in lengths if n > 0), default=0)


async def _serve(
    http: httpx.AsyncClient, server: Http, gateway: Http, models: list[eval_pb2.RegisteredModel], root: Path
) -> tuple[list[str], int]:
    """Step 2: load ``models`` and route the gateway to the server; the smallest context seen
    (0: unknown)."""
    served, context = [], 0
    for model in models:
        ref = ModelRef.of(model.ref)
        folder = _folder(model.uri, root)
        if folder is None:
            raise RuntimeError(f"{ref}'s checkpoint {model.uri} is not a folder on this machine")
        reply = await http.post(
            f"{server.url}/admin/v1/models",
            json={"name": ref.name, "version": ref.version, "path": str(folder)},
            headers=_bearer(server.token),
        )
        if reply.status_code not in (201, 409):
            raise RuntimeError(
                f"loading {ref} into the model server: HTTP {reply.status_code}: {reply.text[:300]}"
            )
        length = reply.json().get("max_model_len") if reply.status_code == 201 else None
        if isinstance(length, int) and length > 0:
            context = length if not context else min(context, length)
        served.append(str(ref))
    reply = await http.post(
        f"{gateway.url}/admin/v1/replicas",
        json={"url": server.url, "token": server.token},
        headers=_bearer(gateway.token),
    )
    if reply.status_code not in (201, 409):
        raise RuntimeError(
            f"adding {server.url} to the gateway: HTTP {reply.status_code}: {reply.text[:300]}"
        )
    return served, context


async def serve_and_drive(
    registry_target: str,
    registry_token: str,
    model_server: Http | None,
    gateway: Http,
    *,
    alias: str,
    root: Path,
    stop: asyncio.Event,
    concurrency: int = 4,
    poll_s: float = 1.0,
    max_requests: int = 2000,
    rate_per_s: float = 5.0,
) -> TrafficReport:
    """Steps 1-3 of the module docstring; returns when the canary decided or ``stop`` is set. A
    registry, model server or gateway that fails ends the traffic with the reason in ``note``
    (the canary then sees too little traffic and is not promoted)."""
    report = TrafficReport()
    try:
        return await _serve_and_drive(
            registry_target,
            registry_token,
            model_server,
            gateway,
            alias,
            root,
            stop,
            concurrency,
            poll_s,
            max_requests,
            rate_per_s,
            report,
        )
    except (RuntimeError, httpx.HTTPError, grpc.aio.AioRpcError) as exc:
        report.note = f"traffic stopped: {exc}"[:500]
        return report


def main_job_traffic(
    ctx: MainJobContext, alias: str, stop: asyncio.Event
) -> asyncio.Task[TrafficReport] | None:
    """:func:`serve_and_drive` as a task for a main-job step (``eval``, ``rlhf``): the platform's
    registry (``eval``) and gateway, and its model server where the platform runs one (``forge
    up`` runs none: the versions' deployments serve them). None when the platform has no gateway."""
    try:
        registry, gateway = ctx.endpoint("eval"), ctx.endpoint("inference_gateway")
    except KeyError:
        return None
    server: Http | None = None
    with contextlib.suppress(KeyError):
        found = ctx.endpoint("model_server")
        server = Http(found.http_url, found.token)
    return asyncio.create_task(
        serve_and_drive(
            registry.grpc_target,
            registry.token,
            server,
            Http(gateway.http_url, gateway.token),
            alias=alias,
            root=ctx.root,
            stop=stop,
        )
    )


async def _serve_and_drive(
    registry_target: str,
    registry_token: str,
    model_server: Http | None,
    gateway: Http,
    alias: str,
    root: Path,
    stop: asyncio.Event,
    concurrency: int,
    poll_s: float,
    max_requests: int,
    rate_per_s: float,
    report: TrafficReport,
) -> TrafficReport:
    async with make_channel(registry_target, token=registry_token) as channel:
        registry = eval_pb2_grpc.EvalServiceStub(channel)
        # 1.
        while True:
            canary, production = await _holder(registry, "canary"), await _holder(registry, "production")
            if canary is not None and production is not None and canary.ref != production.ref:
                break
            if stop.is_set():
                report.note = "no model reached canary"
                return report
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=poll_s)
        report.canary, report.production = str(ModelRef.of(canary.ref)), str(ModelRef.of(production.ref))
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=HTTP_S) as http:
            # 2.
            models = [production, canary]
            # With a model server to fall back on, no wait: the analysis' window runs already.
            if await _answered(http, gateway, models, 0.0 if model_server else SERVED_WAIT_S, stop):
                context = await _context(http, gateway, models)
            elif model_server is not None:
                report.served, context = await _serve(http, model_server, gateway, models, root)
            else:
                report.note = "the gateway does not answer " + " and ".join(
                    str(ModelRef.of(m.ref)) for m in models
                )
                return report
        small = 0 < context < SMALL_CONTEXT
        decided = asyncio.Event()

        async def watch() -> None:
            while not (stop.is_set() or decided.is_set()):
                await asyncio.sleep(poll_s)
                now = await _holder(registry, "canary")
                if now is None or now.ref != canary.ref:
                    decided.set()

        # 3.
        async with openai.AsyncOpenAI(
            base_url=f"{gateway.url.rstrip('/')}/v1", api_key=gateway.token, max_retries=0, timeout=HTTP_S
        ) as sdk:
            gap, next_at = 1.0 / max(rate_per_s, 0.01), [time.monotonic()]

            async def chat() -> None:
                while not (stop.is_set() or decided.is_set()) and report.sent < max_requests:
                    now = time.monotonic()
                    wait, next_at[0] = next_at[0] - now, max(now, next_at[0]) + gap
                    if wait > 0:
                        await asyncio.sleep(wait)
                    report.sent += 1
                    try:
                        raw = await sdk.chat.completions.with_raw_response.create(
                            model=alias,
                            messages=[{"role": "user", "content": QUESTION}],
                            user=f"main-job-canary-{report.sent}",
                            max_tokens=openai.omit if small else MAX_TOKENS,
                        )
                    except openai.APIError as exc:
                        key = (
                            str(exc.status_code)
                            if isinstance(exc, openai.APIStatusError)
                            else type(exc).__name__
                        )
                        report.failed[key] = report.failed.get(key, 0) + 1
                        report.first_error = report.first_error or f"{key}: {exc}"[:300]
                        await asyncio.sleep(0.2)  # a failing gateway is not hammered
                        continue
                    by = raw.headers.get(MODEL_HEADER, "") or "unknown"
                    report.answered_by[by] = report.answered_by.get(by, 0) + 1

            watcher = asyncio.create_task(watch())
            try:
                await asyncio.gather(*(chat() for _ in range(max(1, concurrency))))
            finally:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
        report.seconds = time.monotonic() - started
    return report


def canary_summary(canary: Mapping[str, Any]) -> dict[str, object]:
    """An eval-and-promote result's ``canary`` entry as a step reports it: the decision in a line,
    then the requests each arm had and, per metric, the always-valid p-values of harm and of
    non-inferiority from the deciding look (empty when there was no canary)."""
    if not canary:
        return {}
    try:
        evidence = json.loads(str(canary.get("evidence") or "{}"))
    except ValueError:
        evidence = {}
    metrics = evidence.get("metrics") if isinstance(evidence, dict) else None
    p_values = {
        name: {"harm_p": _round(m.get("harm_p")), "noninf_p": _round(m.get("noninf_p"))}
        for name, m in (metrics or {}).items()
        if isinstance(m, dict)
    }
    return {
        "decision": (
            f"{canary.get('decision')} by {canary.get('decided_by')} after {canary.get('decided_after_s')}s "
            f"({canary.get('policy')}, {canary.get('traffic_percent')} % of traffic): {canary.get('reason')}"
        ),
        "requests": {
            "canary": int(canary.get("canary_requests") or 0),
            "production": int(canary.get("production_requests") or 0),
        },
        "p_values": p_values,
    }


def _round(value: object) -> float | None:
    return float(f"{float(value):.3g}") if isinstance(value, int | float) else None
