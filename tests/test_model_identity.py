"""One model identity from the registry to the answer: what ``make up`` does, with real processes.

The registry (eval, a process) registers a trained checkpoint and promotes it to canary and
production; its ``ModelPromoted`` events travel through a real broker to the gateway (a process),
which moves ``canary``, ``production`` and ``forge-chat``; a replica (here Forge's model server,
a process; in ``forge up`` the main job's vLLM deployment) serves the checkpoint under that
identity and the gateway routes to it. Then a client nobody here wrote — the official ``openai``
SDK — asks for the product names, and each answer says in ``x-forge-model`` which version served
it. A production model nobody serves yet leaves forge-chat answering with the version before, and
once a replica serves it, forge-chat answers with it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from forge.common.v1 import common_pb2
from forge.eval.v1 import eval_pb2, eval_pb2_grpc

from forge_kit.events import ensure_topics
from forge_kit.grpckit import make_channel
from forge_kit.modelref import ModelRef
from forge_kit.testing import ServiceProcess, TansuBroker, base_env
from forge_kit.testing.tiny_llama import save_tiny_llama

pytestmark = pytest.mark.integration

EVAL_TOKEN = "identity-eval-token"
SERVER_TOKEN = "identity-server-token"
GATEWAY_TOKEN = "identity-gateway-token"
TENANT_KEY = "identity-tenant-key"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


@dataclass(frozen=True)
class Endpoint:
    http_url: str
    grpc_target: str
    token: str


@pytest.fixture
def platform(tmp_path: Path) -> Iterator[dict[str, Endpoint]]:
    """A broker of its own (the session's shared one carries other tests' promotions), the eval
    service relaying its events there, a model server with no models, and a gateway consuming
    ``ModelPromoted`` and routing to that model server — wired as ``forge up`` wires them."""
    broker = TansuBroker(log_path=str(tmp_path / "broker.log")).start()
    started: list[ServiceProcess] = []
    try:
        asyncio.run(ensure_topics(broker.bootstrap))

        def start(name: str, token: str, **settings: str) -> ServiceProcess:
            # Each service signs its events with its own key and verifies the others' (forge up: var/secrets).
            env = base_env(name, token=token, kafka=broker.bootstrap, **settings)
            proc = ServiceProcess(
                f"forge_{name}", env=env, cwd=str(tmp_path), log_path=str(tmp_path / f"{name}.log")
            ).start(90)
            started.append(proc)
            return proc

        evals = start(
            "eval",
            EVAL_TOKEN,
            data_dir=str(tmp_path / "eval"),
            response_cache_path=str(tmp_path / "eval" / "cache.sqlite"),
        )
        (tmp_path / "models").mkdir()
        server = start(
            "model_server",
            SERVER_TOKEN,
            models_dir=str(tmp_path / "models"),
            kafka_enabled="false",
            torch_threads="1",
        )
        gateway = start(
            "inference_gateway",
            GATEWAY_TOKEN,
            data_dir=str(tmp_path / "gateway"),
            model_server_url=server.http_url,
            model_server_token=SERVER_TOKEN,
            bootstrap_api_key=TENANT_KEY,
        )
        yield {
            "eval": Endpoint(evals.http_url, evals.grpc_target, EVAL_TOKEN),
            "model_server": Endpoint(server.http_url, server.grpc_target, SERVER_TOKEN),
            "inference_gateway": Endpoint(gateway.http_url, gateway.grpc_target, GATEWAY_TOKEN),
        }
    finally:
        for proc in reversed(started):
            proc.stop()
        broker.stop()


async def register_and_promote(
    registry: Endpoint, model: ModelRef, uri: str, stages: tuple[str, ...]
) -> None:
    """What the eval-and-promote workflow does, through eval's gRPC API (forced: no suite run here)."""
    ref = common_pb2.ModelRef(name=model.name, version=model.version)
    async with make_channel(registry.grpc_target, token=registry.token) as channel:
        stub = eval_pb2_grpc.EvalServiceStub(channel)
        await stub.RegisterModel(eval_pb2.RegisterModelRequest(ref=ref, uri=uri), timeout=10)
        for stage in stages:
            await stub.PromoteModel(
                eval_pb2.PromoteModelRequest(
                    ref=ref, stage=stage, traffic_percent=10, reason="identity test", force=True
                ),
                timeout=10,
            )


async def serve(platform: dict[str, Endpoint], model: ModelRef, folder: Path) -> None:
    """Serve ``folder`` on the model server under the registry's identity of it, and make sure the
    gateway routes there (409: it does already)."""
    server, gateway = platform["model_server"], platform["inference_gateway"]
    async with httpx.AsyncClient(timeout=60) as client:
        body = {"name": model.name, "path": str(folder), "version": model.version}
        reply = await client.post(
            f"{server.http_url}/admin/v1/models",
            json=body,
            headers={"Authorization": f"Bearer {server.token}"},
        )
        assert reply.status_code == 201, reply.text
        reply = await client.post(
            f"{gateway.http_url}/admin/v1/replicas",
            json={"url": server.http_url, "token": server.token},
            headers={"Authorization": f"Bearer {gateway.token}"},
        )
        assert reply.status_code in (201, 409), reply.text
        # The gateway reads a replica's models every MODELS_REFRESH_S: until then it knows no version.
        deadline = asyncio.get_running_loop().time() + 45
        while True:
            listed = await client.get(
                f"{gateway.http_url}/v1/models", headers={"Authorization": f"Bearer {gateway.token}"}
            )
            cards = {c.get("id"): c.get("version") for c in listed.json().get("data", [])}
            if cards.get(model.name) == model.version:
                return
            assert asyncio.get_running_loop().time() < deadline, f"the gateway never listed {model}: {cards}"
            await asyncio.sleep(0.3)


async def ask(
    client: openai.AsyncOpenAI, model: str, *, stream: bool = False, max_tokens: int | None = 8
) -> tuple[str, str, int]:
    """One chat completion through the SDK: (x-forge-model, text, completion tokens);
    ``max_tokens`` None: what the model's context leaves."""
    messages: list[Any] = [{"role": "user", "content": "Good morrow"}]
    limit = {"max_tokens": max_tokens} if max_tokens is not None else {}
    if not stream:
        raw = await client.chat.completions.with_raw_response.create(
            model=model, messages=messages, temperature=0.7, **limit
        )
        completion = raw.parse()
        assert completion.usage is not None
        return (
            raw.headers["x-forge-model"],
            completion.choices[0].message.content or "",
            completion.usage.completion_tokens,
        )
    raw_stream = await client.chat.completions.with_raw_response.create(
        model=model,
        messages=messages,
        temperature=0.7,
        stream=True,
        stream_options={"include_usage": True},
        **limit,
    )
    pieces, tokens = [], 0
    async for chunk in raw_stream.parse():
        pieces += [c.delta.content or "" for c in chunk.choices]
        tokens = chunk.usage.completion_tokens if chunk.usage else tokens
    return raw_stream.headers["x-forge-model"], "".join(pieces), tokens


async def test_the_product_names_answer_with_the_version_the_registry_promoted(
    tmp_path: Path, platform: dict[str, Endpoint]
) -> None:
    # The train step's export, named by the registry as the orchestrator names checkpoints.
    trained = save_tiny_llama(tmp_path / "checkpoints" / "run-7f3a" / "hf", chat_template=CHAT_TEMPLATE)
    model = ModelRef("run-7f3a", "step-120")
    await register_and_promote(platform["eval"], model, str(trained), ("canary", "production"))
    await serve(platform, model, trained)
    client = openai.AsyncOpenAI(
        base_url=f"{platform['inference_gateway'].http_url}/v1", api_key=TENANT_KEY, max_retries=0
    )
    async with client:
        # What a product app does first: ask for the name it was told to use.
        for name in ("forge-chat", "production", "run-7f3a", "run-7f3a:step-120"):
            for stream in (False, True):
                served_by, text, tokens = await ask(client, name, stream=stream)
                assert served_by == "run-7f3a:step-120", (name, stream)
                assert isinstance(text, str) and tokens >= 1, (name, stream)
        # /v1/models lists the aliases a tenant may use, at the version they name, and the models.
        listed = {m.id: m for m in (await client.models.list()).data}
        assert {"forge-chat", "production", "run-7f3a"} <= set(listed)
        assert {getattr(listed[a], "version", None) for a in ("forge-chat", "production")} == {"step-120"}
        # The canary went on to production: the canary stage, and so its alias, is empty.
        assert "canary" not in listed

        # Production moves to a version no replica serves yet: the alias names it at once, but
        # forge-chat keeps answering with the version before until a replica serves the new one.
        # Exported as pre-training exports: no chat template, the main job's 32-token context.
        second = save_tiny_llama(tmp_path / "checkpoints" / "run-9c1d" / "hf", seed=1, context=32)
        newer = ModelRef("run-9c1d", "step-40")
        await register_and_promote(platform["eval"], newer, f"file://{second}", ("production",))
        gateway = platform["inference_gateway"]
        deadline = asyncio.get_running_loop().time() + 30
        async with httpx.AsyncClient(timeout=10) as admin:
            while True:
                reply = await admin.get(
                    f"{gateway.http_url}/admin/v1/aliases",
                    headers={"Authorization": f"Bearer {gateway.token}"},
                )
                named = {a["alias"]: a["model"] for a in reply.json()["aliases"]}
                if named.get("forge-chat") == {"name": newer.name, "version": newer.version}:
                    break
                assert asyncio.get_running_loop().time() < deadline, "forge-chat never moved to run-9c1d"
                await asyncio.sleep(0.3)
        for name in ("forge-chat", "production"):
            assert (await ask(client, name))[0] == "run-7f3a:step-120", name

        # Once a replica serves it, forge-chat answers with it; the earlier model is still there.
        await serve(platform, newer, second)
        assert (await ask(client, "forge-chat", max_tokens=None))[0] == "run-9c1d:step-40"
        assert (await ask(client, "run-7f3a"))[0] == "run-7f3a:step-120"
