"""The main job's ``chat`` step against a real model server and a real gateway (both processes)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from forge_kit.testing import ServiceProcess
from forge_model_server.main_job import MODEL, ChatStepError, chat

SERVER_TOKEN = "server-token"
GATEWAY_TOKEN = "gateway-token"


@dataclass(frozen=True)
class Endpoint:
    http_url: str
    token: str


@dataclass
class Context:
    """What ``forge_cli.mainjob.MainJobContext`` gives a step, for the services started here."""

    root: Path
    services: Mapping[str, Endpoint]
    results: dict[str, Mapping[str, Any]] = field(default_factory=dict)

    def endpoint(self, name: str) -> Endpoint:
        return self.services[name]


async def test_without_a_trained_checkpoint_the_step_says_so(tmp_path: Path) -> None:
    ctx = Context(tmp_path, {}, {"train": {"ok": True}})
    with pytest.raises(ChatStepError, match=r"no trained checkpoint to serve.*steps that ran: train"):
        await chat(ctx)


@pytest.fixture
def platform(tmp_path: Path) -> Iterator[dict[str, ServiceProcess]]:
    """A model server with an empty model directory, and a gateway routing to it, wired as
    ``forge up`` wires them (the gateway's MODEL_SERVER_URL and _TOKEN; every other setting at its
    default, so the gateway learns the new model on its usual ``/v1/models`` refresh)."""
    (tmp_path / "models").mkdir()
    server = ServiceProcess(
        "forge_model_server",
        env={
            "FORGE_MODEL_SERVER_GRPC_PORT": "0",
            "FORGE_MODEL_SERVER_HTTP_PORT": "0",
            "FORGE_MODEL_SERVER_AUTH_TOKEN": SERVER_TOKEN,
            "FORGE_MODEL_SERVER_MODELS_DIR": str(tmp_path / "models"),
            "FORGE_MODEL_SERVER_KAFKA_ENABLED": "false",
            "FORGE_MODEL_SERVER_TORCH_THREADS": "1",
        },
        cwd=str(tmp_path),
        log_path=str(tmp_path / "model_server.log"),
    ).start(60)
    try:
        gateway = ServiceProcess(
            "forge_inference_gateway",
            env={
                "FORGE_INFERENCE_GATEWAY_GRPC_PORT": "0",
                "FORGE_INFERENCE_GATEWAY_HTTP_PORT": "0",
                "FORGE_INFERENCE_GATEWAY_AUTH_TOKEN": GATEWAY_TOKEN,
                "FORGE_INFERENCE_GATEWAY_DATA_DIR": str(tmp_path / "gateway"),
                "FORGE_INFERENCE_GATEWAY_KAFKA_ENABLED": "false",
                "FORGE_INFERENCE_GATEWAY_MODEL_SERVER_URL": server.http_url,
                "FORGE_INFERENCE_GATEWAY_MODEL_SERVER_TOKEN": SERVER_TOKEN,
            },
            cwd=str(tmp_path),
            log_path=str(tmp_path / "gateway.log"),
        ).start(60)
    except BaseException:
        server.stop()
        raise
    yield {"model_server": server, "inference_gateway": gateway}
    gateway.stop()
    server.stop()


@pytest.mark.integration
async def test_the_trained_checkpoint_answers_a_streamed_chat_through_the_gateway(
    tmp_path: Path, platform: dict[str, ServiceProcess], save_llama: Callable[..., Path]
) -> None:
    export = save_llama(
        tmp_path / "checkpoints" / "run-7" / "hf",
        chat_template="{% for m in messages %}{{ m['content'] }}\n{% endfor %}",
    )
    bearer = {"model_server": SERVER_TOKEN, "inference_gateway": GATEWAY_TOKEN}
    ctx = Context(
        tmp_path,
        {name: Endpoint(proc.http_url, bearer[name]) for name, proc in platform.items()},
        # A relative URI is under the repository root, as the train step may report it.
        {"train": {"checkpoint_uri": "checkpoints/run-7/hf", "run_id": "run-7", "step": 5}},
    )
    result = await chat(ctx)
    assert result["ok"] is True and result["model"] == f"{MODEL}:run-7-5"
    assert result["checkpoint"] == str(export)
    tokens, ttft, e2e = result["completion_tokens"], result["ttft_ms"], result["e2e_ms"]
    assert isinstance(tokens, int) and tokens >= 1 and result["finish_reason"] in ("stop", "length")
    assert isinstance(ttft, float) and isinstance(e2e, float) and 0 < ttft <= e2e
    assert result["token_events"] == tokens and isinstance(result["text"], str)
    # The model server lists the checkpoint; the gateway routes its name there.
    auth = {"Authorization": f"Bearer {SERVER_TOKEN}"}
    server_url = platform["model_server"].http_url
    cards = httpx.get(f"{server_url}/v1/models", headers=auth).json()["data"]
    assert [(c["id"], c["version"], c["root"]) for c in cards] == [(MODEL, "run-7-5", MODEL)]
    # The next `make up` trains again: a new run, exported as pre-training exports (no chat
    # template, so the server's default chat format) with the main job's 32-token context (the
    # prompt leaves little room: max_tokens is left to the server), replaces the model and answers.
    second = save_llama(tmp_path / "checkpoints" / "run-8" / "hf", seed=1, context=32)
    ctx.results["train"] = {"checkpoint_uri": str(second), "run_id": "run-8", "step": 9}
    again = await chat(ctx)
    assert again["ok"] is True and again["model"] == f"{MODEL}:run-8-9"
    assert again["token_events"] == again["completion_tokens"] >= 1
    cards = httpx.get(f"{server_url}/v1/models", headers=auth).json()["data"]
    assert [(c["id"], c["version"], c["root"]) for c in cards] == [(MODEL, "run-8-9", MODEL)]
