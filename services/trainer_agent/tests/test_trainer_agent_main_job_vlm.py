"""The main job's ``vlm`` step: its inputs, and its serve-and-ask half against real model_server
and gateway processes (the training half is the platform's ``training`` workflow, as the ``train``
step runs it; here a tiny random LLaVA stands in for the trained folder): the folder is loaded
under its name and version, the gateway routes to it, and a chat completion with a generated
scene as an ``image_url`` part comes back from that version with the image counted in its usage."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from forge_kit.testing import ServiceProcess
from forge_kit.testing.tiny_llava import save_tiny_llava
from forge_trainer_agent.main_job_vlm import (
    VlmStepError,
    language_parent,
    scene_question,
    serve_and_ask,
    training_input,
)

pytest.importorskip("forge_training.vlm.world")
SERVER_TOKEN = "vlm-step-server"
GATEWAY_TOKEN = "vlm-step-gateway"


@dataclass(frozen=True)
class Endpoint:
    http_url: str
    grpc_target: str
    token: str


@dataclass
class Context:
    root: Path
    results: dict[str, Mapping[str, Any]] = field(default_factory=dict)

    def endpoint(self, name: str) -> Endpoint:
        raise KeyError(name)


def test_the_step_needs_the_train_steps_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(VlmStepError, match="checkpoint_uri"):
        language_parent(Context(tmp_path))
    ctx = Context(tmp_path, {"train": {"checkpoint_uri": "var/run/hf"}})
    assert language_parent(ctx) == tmp_path / "var/run/hf"
    run = training_input(language_parent(ctx))
    assert run["recipe"] == "vlm_joint" and f"init.parent={tmp_path / 'var/run/hf'}" in run["overrides"]
    # The overrides are ones the recipe takes (the workflow's job would fail on an unknown key).
    from forge_training.recipes import build

    config = build("vlm_joint", dict(o.split("=", 1) for o in run["overrides"]))
    assert config.max_steps == 40 and not config.vlm.from_scratch


def test_the_scene_is_generated_deterministically() -> None:
    png, question, answer, qtype = scene_question()
    assert png.startswith(b"\x89PNG") and question.endswith(("?", ".")) and answer
    assert scene_question() == (png, question, answer, qtype)


@pytest.fixture
def platform(tmp_path: Path) -> Iterator[tuple[Endpoint, Endpoint]]:
    started: list[ServiceProcess] = []
    try:

        def start(name: str, env: dict[str, str]) -> ServiceProcess:
            prefix = f"FORGE_{name.upper()}_"
            full = {
                prefix + k: v
                for k, v in {"GRPC_PORT": "0", "HTTP_PORT": "0", "KAFKA_ENABLED": "false", **env}.items()
            }
            proc = ServiceProcess(
                f"forge_{name}", env=full, cwd=str(tmp_path), log_path=str(tmp_path / f"{name}.log")
            ).start(90)
            started.append(proc)
            return proc

        (tmp_path / "models").mkdir()
        server = start(
            "model_server",
            {"AUTH_TOKEN": SERVER_TOKEN, "MODELS_DIR": str(tmp_path / "models"), "TORCH_THREADS": "1"},
        )
        gateway = start(
            "inference_gateway",
            {
                "AUTH_TOKEN": GATEWAY_TOKEN,
                "DATA_DIR": str(tmp_path / "gateway"),
                "MODELS_REFRESH_S": "1",
                "BOOTSTRAP_API_KEY": "vlm-step-tenant",
            },
        )
        yield (
            Endpoint(server.http_url, server.grpc_target, SERVER_TOKEN),
            Endpoint(gateway.http_url, gateway.grpc_target, GATEWAY_TOKEN),
        )
    finally:
        for proc in reversed(started):
            proc.stop()


async def test_serve_and_ask_through_the_gateway(platform: tuple[Endpoint, Endpoint], tmp_path: Path) -> None:
    server, gateway = platform
    folder = save_tiny_llava(tmp_path / "trained" / "hf")
    result = await serve_and_ask(server, gateway, folder, "shapes-vlm", "step-40")
    assert result["ok"] is True, result
    assert result["served_by"] == "shapes-vlm:step-40" and result["image_tokens"] == 16
    assert (
        int(str(result["prompt_tokens"])) > 16 and result["expected"] and isinstance(result["correct"], bool)
    )
