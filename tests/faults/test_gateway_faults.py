"""kill -9 of the inference gateway, and of a model_server replica, under streaming load.

Two real model_server replicas serve a random tiny Llama; the gateway knows the first from its
settings and the second because an admin added it through the API (a row in the gateway's own
database). Product-app clients stream completions with a tenant API key that an admin created;
when the gateway is unreachable, or a stream breaks off or reports an error, the client sends the
request again, as an app would.

1. The gateway is killed with SIGKILL mid-run and started again in place. Afterwards: every
   request was answered in full exactly once, no client ever saw a 5xx, only the streams cut by
   the kill broke (at most one per client), the tenant's key and the added replica survived the
   restart (listed and healthy), and neither replica holds a running request or KV blocks for the
   streams the dead gateway left open (the cut connection aborted them).
2. The replica with streams open is killed. The gateway stays up: those streams, and only those,
   end with an error event (never cut silently or passed off as complete), the rest is routed to
   the survivor, and once the replica is started again the gateway probes it back in and routes
   to it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from fault_platform import model_server_process, vllm_metric, wait_ready

from forge_kit.testing import ServiceProcess, base_env, free_port, tiny_llama

pytestmark = [pytest.mark.integration, pytest.mark.faults_full, pytest.mark.timeout(300)]
TOKEN = "faults-gateway-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
CLIENTS = 4
REQUESTS = 48
MAX_TOKENS = 8
LONG_TOKENS = 96  # long enough that streams are open on a replica when it dies


@dataclass
class Tally:
    """What the clients saw: completed requests by id, and every failed attempt by kind."""

    completed: Counter[str] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)


async def stream_once(client: httpx.AsyncClient, key: str, prompt: str, max_tokens: int) -> str:
    """One attempt: "ok" when the stream carried text and ended with ``[DONE]``; "error event" when
    the gateway reported a failure inside the stream (as vLLM does: an error event, then
    ``[DONE]``); "no [DONE]" when it simply stopped."""
    body = {"model": "llama", "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {key}"}
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as reply:
        if reply.status_code != 200:
            await reply.aread()
            raise httpx.HTTPStatusError(f"status {reply.status_code}", request=reply.request, response=reply)
        pieces, done, error = 0, False, False
        async for line in reply.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {"):
                event = json.loads(line[6:])
                error = error or "error" in event
                pieces += len(event.get("choices", []))
        if error:
            return "error event"
        return "ok" if done and pieces > 0 else "no [DONE]"


async def app_client(
    base_url: str,
    key: str,
    queue: asyncio.Queue[str],
    tally: Tally,
    *,
    max_tokens: int = MAX_TOKENS,
    retry_after_s: float = 0.1,
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
                    outcome = await stream_once(client, key, f"To be {request_id}", max_tokens)
                    tally.statuses[200] += 1
                    if outcome == "ok":
                        tally.completed[request_id] += 1
                        break
                    tally.failures[outcome] += 1
                except httpx.HTTPStatusError as exc:
                    tally.statuses[exc.response.status_code] += 1
                    tally.failures[f"HTTP {exc.response.status_code}"] += 1
                except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as exc:
                    tally.failures[type(exc).__name__] += 1
                await asyncio.sleep(retry_after_s)


def replica_gauges(proc: ServiceProcess) -> tuple[float, float, float]:
    """(running requests, KV cache use, finished requests) from the replica's vLLM metrics."""
    return (
        vllm_metric(proc, "vllm:num_requests_running"),
        vllm_metric(proc, "vllm:kv_cache_usage_perc"),
        vllm_metric(proc, "vllm:request_success_total"),
    )


def gateway_process(root: Path, first_replica: str) -> ServiceProcess:
    """The gateway on ports of its own, knowing ``first_replica`` from its settings; an ejected
    replica is probed again within 2 s (its back-off capped there)."""
    return ServiceProcess(
        "forge_inference_gateway",
        env=base_env(
            "inference_gateway",
            token=TOKEN,
            data_dir=root / "gateway",
            grpc_port=free_port(),
            http_port=free_port(),
            model_server_url=first_replica,
            model_server_token=TOKEN,
            response_cache_ttl_s="0",
            eject_max_s="2",
        ),
        log_path=str(root / "gateway.log"),
    )


async def start_serving(root: Path) -> tuple[list[ServiceProcess], ServiceProcess, str]:
    """Two replicas and the gateway; an admin creates the tenant (its key is returned) and adds the
    second replica through the API."""
    tiny_llama.save_tiny_llama(root / "models" / "llama")
    replicas = [model_server_process(root, f"replica-{n}", TOKEN) for n in "ab"]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda p: p.start(90), replicas))
    gateway = gateway_process(root, replicas[0].http_url).start(60)
    await asyncio.to_thread(wait_ready, gateway)
    async with httpx.AsyncClient(base_url=gateway.http_url, timeout=30, headers=ADMIN) as http:
        created = await http.post(
            "/admin/v1/tenants", json={"name": "faults-app", "priority_class": "interactive"}
        )
        assert created.status_code == 201, created.text
        added = await http.post("/admin/v1/replicas", json={"url": replicas[1].http_url, "token": TOKEN})
        assert added.status_code == 201, added.text
    return replicas, gateway, created.json()["api_key"]


def request_queue(first: int, count: int) -> asyncio.Queue[str]:
    queue: asyncio.Queue[str] = asyncio.Queue()
    for n in range(first, first + count):
        queue.put_nowait(f"r{n:03d}")
    return queue


async def upstream_settled(replicas: list[ServiceProcess]) -> list[tuple[float, float, float]]:
    """The replicas' gauges once nothing runs and no KV block is held (or after 20 s)."""
    deadline = time.monotonic() + 20
    while True:
        gauges = [replica_gauges(p) for p in replicas]
        if all(running == 0 and kv == 0 for running, kv, _ in gauges) or time.monotonic() > deadline:
            return gauges
        await asyncio.sleep(0.2)


async def test_gateway_kill_loses_no_request_and_no_state(tmp_path: Path) -> None:
    replicas, gateway, key = await start_serving(tmp_path)
    try:
        before = [replica_gauges(p)[2] for p in replicas]
        queue = request_queue(0, REQUESTS)
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
        async with httpx.AsyncClient(base_url=gateway.http_url, timeout=30, headers=ADMIN) as http:
            listed = (await http.get("/admin/v1/replicas")).json()["replicas"]
            tenants = (await http.get("/admin/v1/tenants")).json()["tenants"]
        # 3. Nothing left running upstream (the streams the dead gateway held were aborted).
        gauges = await upstream_settled(replicas)
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
    broken += tally.failures["no [DONE]"] + tally.failures["error event"]
    assert broken <= CLIENTS  # only streams open at the kill broke off
    assert {r["url"] for r in listed} == {p.http_url for p in replicas}
    assert all(r["healthy"] for r in listed), listed
    assert "faults-app" in {t["name"] for t in tenants}
    assert all(running == 0 and kv == 0 for running, kv, _ in gauges), gauges
    assert recovery <= 15


async def test_model_server_kill_fails_over_and_the_replica_rejoins(tmp_path: Path) -> None:
    """kill -9 of one replica under the same load: the streams it was serving break (the client
    sends them again), every other request is routed to the survivor (the gateway retries a
    replica it cannot reach on another one), and once the replica is back the gateway routes to
    it again."""
    replicas, gateway, key = await start_serving(tmp_path)
    try:
        queue, tally = request_queue(0, REQUESTS), Tally()
        clients = [
            asyncio.create_task(app_client(gateway.http_url, key, queue, tally, max_tokens=LONG_TOKENS))
            for _ in range(CLIENTS)
        ]
        # 1. Kill -9 one replica once a quarter is answered; the rest is served by the other.
        while sum(tally.completed.values()) < REQUESTS // 4:
            await asyncio.sleep(0.02)
        # The replica with streams open (routing keeps shared prefixes on one replica).
        while True:
            running = [replica_gauges(p)[0] for p in replicas]
            if max(running) > 0:
                break
            await asyncio.sleep(0.005)
        victim, open_streams = replicas[running.index(max(running))], max(running)
        victim.kill()
        killed = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*clients), timeout=180)
        # 2. Start it again in place; the gateway probes it back in and routes to it.
        await asyncio.to_thread(victim.start, 90)
        back: float | None = None
        async with httpx.AsyncClient(base_url=gateway.http_url, timeout=30, headers=ADMIN) as http:
            while time.monotonic() - killed < 120:
                listed = (await http.get("/admin/v1/replicas")).json()["replicas"]
                if all(r["healthy"] for r in listed):
                    back = round(time.monotonic() - killed, 1)
                    break
                await asyncio.sleep(0.2)
        rejoined = replica_gauges(victim)[2]
        queue = request_queue(REQUESTS, REQUESTS // 2)
        await asyncio.gather(*(app_client(gateway.http_url, key, queue, tally) for _ in range(CLIENTS)))
        gauges = await upstream_settled(replicas)
    finally:
        gateway.stop()
        for proc in replicas:
            proc.stop()
    print(
        f"\nfault model_server kill -9: healthy again after {back}s; failed attempts retried: "
        f"{dict(tally.failures)} ({open_streams:.0f} streams were open on it); the restarted replica served "
        f"{gauges[replicas.index(victim)][2] - rejoined:.0f} of the last "
        f"{REQUESTS // 2}"
    )
    total = REQUESTS + REQUESTS // 2
    assert sorted(tally.completed) == [f"r{n:03d}" for n in range(total)]
    assert set(tally.completed.values()) == {1}
    assert set(tally.statuses) == {200}, tally.statuses  # the gateway never answered 5xx
    # The gateway stayed up: the only failures are the streams open on the victim, each told so
    # by an error event in its stream (never a silent cut, never a truncated answer sent as done).
    assert set(tally.failures) <= {"error event"}, tally.failures
    assert tally.failures["error event"] <= CLIENTS  # one open stream per client at most
    assert back is not None and back <= 60
    assert gauges[replicas.index(victim)][2] - rejoined > 0  # routed to again after restart
    assert all(running == 0 and kv == 0 for running, kv, _ in gauges), gauges
