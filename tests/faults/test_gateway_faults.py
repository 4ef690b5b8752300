"""kill -9 of the inference gateway under streaming load.

Two real model_server replicas serve a random tiny Llama; the gateway knows the first from its
settings and the second because an admin added it through the API (a row in the gateway's own
database). Product-app clients stream completions with a tenant API key that an admin created;
when the gateway is unreachable, or a stream breaks off, the client sends the request again, as an
app would. The gateway is killed with SIGKILL mid-run and started again in place.

Afterwards: every request was answered in full exactly once to its client, no client ever saw a
5xx, only the streams cut by the kill broke (at most one per client), the tenant's key and the added
replica survived the restart (both replicas serve afterwards), and neither replica holds a running
request or KV blocks for the streams the dead gateway left open (the cut connection aborted them).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from fault_platform import wait_ready

from forge_kit.testing import ServiceProcess, free_port, tiny_llama

pytestmark = [pytest.mark.integration, pytest.mark.faults_full, pytest.mark.timeout(300)]
TOKEN = "faults-gateway-token"
CLIENTS = 4
REQUESTS = 48
MAX_TOKENS = 8


def model_server(root: Path, name: str) -> ServiceProcess:
    return ServiceProcess(
        "forge_model_server",
        env={
            "FORGE_MODEL_SERVER_GRPC_PORT": "0",
            "FORGE_MODEL_SERVER_HTTP_PORT": "0",
            "FORGE_MODEL_SERVER_AUTH_TOKEN": TOKEN,
            "FORGE_MODEL_SERVER_MODELS_DIR": str(root / "models"),
            "FORGE_MODEL_SERVER_KAFKA_ENABLED": "false",
            "FORGE_MODEL_SERVER_TORCH_THREADS": "1",
        },
        cwd=str(root),
        log_path=str(root / f"{name}.log"),
    )


@dataclass
class Tally:
    """What the clients saw: completed requests by id, and every failed attempt by kind."""

    completed: Counter[str] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)


async def stream_once(client: httpx.AsyncClient, key: str, prompt: str) -> bool:
    """One attempt; True when the stream ended with ``[DONE]`` after ``MAX_TOKENS`` tokens."""
    body = {"model": "llama", "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {key}"}
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as reply:
        if reply.status_code != 200:
            await reply.aread()
            raise httpx.HTTPStatusError(f"status {reply.status_code}", request=reply.request, response=reply)
        pieces, done = 0, False
        async for line in reply.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {"):
                pieces += len(json.loads(line[6:]).get("choices", []))
        return done and pieces > 0


async def app_client(
    base_url: str, key: str, queue: asyncio.Queue[str], tally: Tally, *, retry_after_s: float = 0.1
) -> None:
    """Take request ids until the queue is empty; send each until it completes once."""
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        while True:
            try:
                request_id = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            while True:
                try:
                    if await stream_once(client, key, f"To be {request_id}"):
                        tally.completed[request_id] += 1
                        tally.statuses[200] += 1
                        break
                    tally.failures["stream ended without [DONE]"] += 1
                except httpx.HTTPStatusError as exc:
                    tally.statuses[exc.response.status_code] += 1
                    tally.failures[f"HTTP {exc.response.status_code}"] += 1
                except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as exc:
                    tally.failures[type(exc).__name__] += 1
                await asyncio.sleep(retry_after_s)


def replica_gauges(proc: ServiceProcess) -> tuple[float, float, float]:
    """(running requests, KV cache use, finished requests) from the replica's vLLM metrics."""
    text = httpx.get(f"{proc.http_url}/metrics", timeout=5).text
    values: defaultdict[str, float] = defaultdict(float)
    for line in text.splitlines():
        for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:request_success_total"):
            if line.startswith(name + "{"):
                values[name] += float(line.rsplit(" ", 1)[1])
    return (
        values["vllm:num_requests_running"],
        values["vllm:kv_cache_usage_perc"],
        values["vllm:request_success_total"],
    )


async def test_gateway_kill_loses_no_request_and_no_state(tmp_path: Path) -> None:
    tiny_llama.save_tiny_llama(tmp_path / "models" / "llama")
    replicas = [model_server(tmp_path, "replica-a"), model_server(tmp_path, "replica-b")]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda p: p.start(90), replicas))
    gateway = ServiceProcess(
        "forge_inference_gateway",
        env={
            "FORGE_INFERENCE_GATEWAY_GRPC_PORT": str(free_port()),
            "FORGE_INFERENCE_GATEWAY_HTTP_PORT": str(free_port()),
            "FORGE_INFERENCE_GATEWAY_AUTH_TOKEN": TOKEN,
            "FORGE_INFERENCE_GATEWAY_DATA_DIR": str(tmp_path / "gateway"),
            "FORGE_INFERENCE_GATEWAY_KAFKA_ENABLED": "false",
            "FORGE_INFERENCE_GATEWAY_MODEL_SERVER_URL": replicas[0].http_url,
            "FORGE_INFERENCE_GATEWAY_MODEL_SERVER_TOKEN": TOKEN,
            "FORGE_INFERENCE_GATEWAY_RESPONSE_CACHE_TTL_S": "0",
        },
        log_path=str(tmp_path / "gateway.log"),
    ).start(60)
    admin = {"Authorization": f"Bearer {TOKEN}"}
    try:
        await asyncio.to_thread(wait_ready, gateway)
        async with httpx.AsyncClient(base_url=gateway.http_url, timeout=30, headers=admin) as http:
            created = await http.post(
                "/admin/v1/tenants", json={"name": "faults-app", "priority_class": "interactive"}
            )
            assert created.status_code == 201, created.text
            key = created.json()["api_key"]
            added = await http.post("/admin/v1/replicas", json={"url": replicas[1].http_url})
            assert added.status_code == 201, added.text
        before = [replica_gauges(p)[2] for p in replicas]
        queue: asyncio.Queue[str] = asyncio.Queue()
        for n in range(REQUESTS):
            queue.put_nowait(f"r{n:03d}")
        tally = Tally()
        clients = [
            asyncio.create_task(app_client(gateway.http_url, key, queue, tally)) for _ in range(CLIENTS)
        ]
        # 1. Kill -9 once a quarter is answered, with streams open; start again in place.
        while sum(tally.completed.values()) < REQUESTS // 4:
            await asyncio.sleep(0.02)
        gateway.kill()
        killed = time.monotonic()
        answered_before_kill = sum(tally.completed.values())
        await asyncio.to_thread(gateway.start, 60)
        await asyncio.to_thread(wait_ready, gateway)
        recovery = time.monotonic() - killed
        at_restart = [replica_gauges(p)[2] for p in replicas]
        await asyncio.wait_for(asyncio.gather(*clients), timeout=180)
        # 2. State the admin made survived; both replicas served after the restart.
        async with httpx.AsyncClient(base_url=gateway.http_url, timeout=30, headers=admin) as http:
            listed = (await http.get("/admin/v1/replicas")).json()["replicas"]
            tenants = (await http.get("/admin/v1/tenants")).json()["tenants"]
        # 3. Nothing left running upstream (the streams the dead gateway held were aborted).
        deadline = time.monotonic() + 20
        while True:
            gauges = [replica_gauges(p) for p in replicas]
            if all(running == 0 and kv == 0 for running, kv, _ in gauges) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
    finally:
        gateway.stop()
        for proc in replicas:
            proc.stop()
    served = [g[2] - b for g, b in zip(gauges, before, strict=True)]
    served_after = [g[2] - b for g, b in zip(gauges, at_restart, strict=True)]
    print(
        f"\nfault gateway kill -9: recovered in {recovery:.1f}s; {answered_before_kill} answered before the "
        f"kill; failed attempts retried: {dict(tally.failures)}; served per replica {served} "
        f"({served_after} after the restart)"
    )
    assert sorted(tally.completed) == [f"r{n:03d}" for n in range(REQUESTS)]
    assert set(tally.completed.values()) == {1}  # each answered in full exactly once
    assert set(tally.statuses) == {200}, tally.statuses  # no 5xx (nor anything else) to a client
    broken = tally.failures["RemoteProtocolError"] + tally.failures["ReadError"]
    broken += tally.failures["stream ended without [DONE]"]
    assert broken <= CLIENTS  # only streams open at the kill broke off
    assert {r["url"] for r in listed} == {p.http_url for p in replicas}
    assert all(r["healthy"] for r in listed), listed
    assert "faults-app" in {t["name"] for t in tenants}
    assert all(s > 0 for s in served_after), served_after  # the admin-added one too, after restart
    assert all(running == 0 and kv == 0 for running, kv, _ in gauges), gauges
    assert recovery <= 15
