"""The gateway in front of two real model_server processes serving a Llama checkpoint with weights:
streamed generation routed over both, the response cache on real output, a replica killed mid-run."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from forge_inference_gateway.replicas.pool import RoutingPolicy, parse_load
from forge_inference_gateway.service import InferenceGateway
from forge_kit.testing import ServiceProcess, base_env, tiny_llama

pytestmark = pytest.mark.integration
TOKEN = "upstream-token"  # what build_gateway presents to replicas
CORPUS = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 8


def save_tiny_llama(folder: Path) -> Path:
    """A random 2-layer Llama with a byte-level BPE tokenizer, in Hugging Face format as the trainer
    exports it (the model server's own tests build the same shape)."""
    return tiny_llama.save_tiny_llama(folder, corpus=[CORPUS])


@pytest.fixture(scope="module")
def model_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServiceProcess]]:
    """Two model_server processes over one models folder holding ``llama``."""
    root = tmp_path_factory.mktemp("replicas")
    save_tiny_llama(root / "models" / "llama")
    procs = []
    for i in range(2):
        env = base_env("model_server", token=TOKEN, models_dir=str(root / "models"), torch_threads="1")
        procs.append(
            ServiceProcess("forge_model_server", env=env, cwd=str(root), log_path=str(root / f"log{i}"))
        )
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda p: p.start(60), procs))
    yield procs
    for proc in procs:
        proc.stop()


def served_requests(proc: ServiceProcess) -> float:
    """Requests the replica finished, from its own vLLM counter."""
    text = httpx.get(f"{proc.http_url}/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total{")
    )


async def _stream(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[int, str]:
    async with client.stream("POST", "/v1/completions", json=body) as reply:
        text = ""
        async for line in reply.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                text += "".join(c.get("text", "") for c in event.get("choices", []))
        return reply.status_code, text


async def test_streams_spread_over_real_replicas_and_survive_one_dying(
    model_servers: list[ServiceProcess],
    make_gateway: Callable[..., Awaitable[InferenceGateway]],
    client_for: Any,
    admin_headers: dict[str, str],
) -> None:
    gateway = await make_gateway(
        [p.http_url for p in model_servers], policy=RoutingPolicy(eject_after=1, eject_base_s=30)
    )
    await gateway.pool.refresh()
    assert all(parse_load(httpx.get(f"{p.http_url}/metrics").text).running == 0 for p in model_servers)
    before = [served_requests(p) for p in model_servers]
    # Greedy: 8 sampled tokens of a random model may decode to nothing (byte pieces of no whole
    # character), which would read as a lost answer; each prompt is new, so none is a cache hit.
    body = {"model": "llama", "max_tokens": 8, "temperature": 0, "stream": True, "ignore_eos": True}
    async with client_for(gateway) as client:
        models = (await client.get("/v1/models")).json()["data"]
        assert [(m["id"], m["ready_replicas"]) for m in models] == [("llama", 2)]
        results = await asyncio.gather(*(_stream(client, {**body, "prompt": f"To be {i}"}) for i in range(8)))
        assert [status for status, _ in results] == [200] * 8 and all(text for _, text in results)
        after = [served_requests(p) for p in model_servers]
        assert sum(a - b for a, b in zip(after, before, strict=True)) == 8
        assert all(a > b for a, b in zip(after, before, strict=True))  # both replicas took a share
        # Greedy output of the real model is cached and replayed.
        greedy = {"model": "llama", "prompt": "To be", "max_tokens": 6, "temperature": 0}
        first, again = [await client.post("/v1/completions", json=greedy) for _ in range(2)]
        assert (first.headers["x-forge-cache"], again.headers["x-forge-cache"]) == ("miss", "hit")
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        # One replica dies: every request still completes, on the other.
        model_servers[1].kill()
        results = await asyncio.gather(
            *(_stream(client, {**body, "prompt": f"or not {i}"}) for i in range(6))
        )
        assert [status for status, _ in results] == [200] * 6 and all(text for _, text in results)
        listed = (await client.get("/admin/v1/replicas", headers=admin_headers)).json()["replicas"]
        health = {r["url"]: r["healthy"] for r in listed}
        assert health == {model_servers[0].http_url: True, model_servers[1].http_url: False}
