"""The link from the inference gateway to its model server loses 30 % of its packets with 500 ms
latency each way (``gateway_lossy_link`` in ``scenarios.yaml``) while apps stream completions
through the ``openai`` SDK.

A real model_server serves a random tiny Llama behind a fault proxy; the gateway (request
deadline 8 s) knows only the proxy. Clients stream completions with a tenant key, and send a
request again (same id) when an attempt fails. Every attempt is in a history. Checked:

* deadlines held: no attempt outlived the gateway's deadline by more than the scheduling slack;
* clear errors: an attempt that failed did so with an HTTP status and a message, or an error
  event inside the stream — never a stream cut short or passed off as complete, never a client
  timeout (``info``);
* every request done once in the end (a retried request completes; none needs a second answer);
* no stuck streams: after the heal the model server runs nothing and holds no KV block.

It starts a model server (a minute on a loaded 2-core machine): ``make faults-long``.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import openai
import pytest
from fault_platform import model_server_process, wait_ready
from faultkit.history import History, check_writes, verdict
from faultkit.scenario import Targets, load_scenario, run_timeline
from test_gateway_faults import ADMIN, TOKEN, gateway_process, upstream_settled

from forge_kit.testing import tiny_llama
from forge_kit.testing.fault_proxy import FaultProxy

pytestmark = [pytest.mark.integration, pytest.mark.faults_long, pytest.mark.timeout(600)]
DEADLINE_S = 8.0
SLACK_S = 4.0
CLIENTS = 4
MAX_TOKENS = 16


async def app(
    base_url: str, key: str, name: str, history: History, until: float, stats: dict[str, float]
) -> None:
    """Send requests one after another until ``until``; each until it completes once."""
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=key, timeout=DEADLINE_S * 4, max_retries=0)
    try:
        n = 0
        while time.monotonic() < until:
            request_id = f"{name}-{n:03d}"
            n += 1
            while True:
                op = history.invoke(name, "complete", request_id)
                started = time.monotonic()
                try:
                    stream = await client.completions.create(
                        model="llama", prompt=f"To be {request_id}", max_tokens=MAX_TOKENS, stream=True,
                        extra_body={"ignore_eos": True},
                    )  # fmt: skip
                    pieces, finished = 0, False
                    async for chunk in stream:
                        pieces += len(chunk.choices)
                        finished = finished or any(c.finish_reason for c in chunk.choices)
                    if finished and pieces:
                        history.ok(op, pieces)
                    else:
                        history.info(op, f"stream ended without a finish ({pieces} pieces)")
                except openai.APITimeoutError as exc:
                    history.info(op, f"client timeout: {exc}")
                except openai.APIStatusError as exc:
                    history.fail(op, f"{exc.status_code} {exc.message}")
                except openai.APIConnectionError as exc:
                    history.info(op, f"connection: {exc!r}")
                except openai.APIError as exc:  # an error event inside the stream
                    history.fail(op, f"error event: {exc.message}")
                stats["longest_s"] = max(stats["longest_s"], time.monotonic() - started)
                if history.ops[-1].type == "ok":
                    break
                await asyncio.sleep(0.2)
    finally:
        await client.close()


async def test_gateway_over_a_lossy_slow_link(tmp_path: Path) -> None:
    scenario = load_scenario("gateway_lossy_link")
    tiny_llama.save_tiny_llama(tmp_path / "models" / "llama")
    replica = model_server_process(tmp_path, "replica", TOKEN).start(120)
    link = FaultProxy(("127.0.0.1", replica.http_port or 0), name="model_server").start()
    gateway = gateway_process(tmp_path, f"http://{link.address}")
    gateway.env["FORGE_INFERENCE_GATEWAY_REQUEST_TIMEOUT_S"] = str(DEADLINE_S)
    history, stats = History(), {"longest_s": 0.0}
    try:
        gateway.start(60)
        await asyncio.to_thread(wait_ready, gateway)
        async with httpx.AsyncClient(base_url=gateway.http_url, timeout=30, headers=ADMIN) as http:
            created = await http.post(
                "/admin/v1/tenants", json={"name": "faults-app", "priority_class": "interactive"}
            )
            assert created.status_code == 201, created.text
        key = created.json()["api_key"]
        until = time.monotonic() + scenario.duration_s
        apps = [
            asyncio.create_task(app(gateway.http_url, key, f"app{c}", history, until, stats))
            for c in range(CLIENTS)
        ]
        applied = await run_timeline(scenario, Targets(links={"model_server": link}))
        healed = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*apps), timeout=180)
        recovery = time.monotonic() - healed
        running, kv, _ = (await upstream_settled([replica]))[0]
    finally:
        gateway.stop()
        link.stop()
        replica.stop()
    history.dump(tmp_path / "gateway_lossy_link.history.jsonl")
    done = {op.key: 1 for op in history.ops if op.type == "ok"}
    result = verdict(history, check_writes(history, "complete", done, where="the completed requests"))
    failures = [op for op in history.ops if op.type == "fail"]
    unclear = [op for op in history.ops if op.type == "info"]
    print(
        f"\nfault gateway_lossy_link: {len(done)} requests, {result.ops_checked} operations checked, "
        f"{len(failures)} attempts refused clearly, {len(unclear)} unclear; longest attempt "
        f"{stats['longest_s']:.1f}s (deadline {DEADLINE_S:g}s); proxy delayed {link.stats.delayed_chunks} chunks; "
        f"apps done {recovery:.1f}s after the heal ({applied[0].healed_s:.0f}s of faults)"
    )
    result.assert_valid()
    assert not unclear, [str(op) for op in unclear[:5]]
    assert stats["longest_s"] <= DEADLINE_S + SLACK_S
    assert link.stats.delayed_chunks > 0  # the loss bit
    assert (running, kv) == (0, 0)  # no stream left running upstream
