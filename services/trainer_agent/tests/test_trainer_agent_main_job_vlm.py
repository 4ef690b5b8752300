"""The main job's ``vlm`` step: its inputs, and its serve-and-ask half against real scheduler,
trainer agent, gateway and orchestrator processes (the training half is the platform's
``training`` workflow, as the ``train`` step runs it; here a tiny random LLaVA stands in for the
trained folder): the folder is deployed under its name and version (Forge's engine, one replica
trained folder is deployed under its name and version (vLLM, one replica placed by the scheduler
and started by the agent), the gateway routes to it, a chat completion with a generated scene as
an ``image_url`` part comes back from that version with the image counted in its prompt, and the
deployment is undeployed."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from forge.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc

from forge_kit.grpckit import make_channel
from forge_kit.testing import ServiceProcess, TemporalDevServer, base_env, eventually
from forge_kit.testing.tiny_llava import save_tiny_llava
from forge_kit.vllm import vllm_python
from forge_trainer_agent.main_job_vlm import (
    VlmStepError,
    deploy_and_ask,
    language_parent,
    scene_question,
    training_input,
)

pytest.importorskip("forge_training.vlm.world")
SCHEDULER_TOKEN = "vlm-step-scheduler"
ORCHESTRATOR_TOKEN = "vlm-step-orchestrator"
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
def platform(tmp_path: Path, temporal_server: TemporalDevServer) -> Iterator[tuple[Endpoint, Endpoint]]:
    """The scheduler, a trainer agent with one simulated GPU, the gateway (no replica of its own)
    and the orchestrator, whose ``deployment`` workflow runs the VLM's replica."""
    started: list[ServiceProcess] = []
    try:

        def start(name: str, token: str, **settings: str) -> ServiceProcess:
            proc = ServiceProcess(
                f"forge_{name}",
                env=base_env(name, token=token, data_dir=tmp_path / name, **settings),
                cwd=str(tmp_path),
                log_path=str(tmp_path / f"{name}.log"),
            ).start(90)
            started.append(proc)
            return proc

        scheduler = start("scheduler", SCHEDULER_TOKEN)
        start(
            "trainer_agent",
            SCHEDULER_TOKEN,
            scheduler_target=scheduler.grpc_target,
            scheduler_token=SCHEDULER_TOKEN,
            node_name=f"vlm-node-{uuid.uuid4().hex[:6]}",
            gpus="SIMx1",
            job_sandbox="",
            stop_grace_s="10",
        )
        gateway = start(
            "inference_gateway",
            GATEWAY_TOKEN,
            model_server_url="",
            models_refresh_s="1",
            bootstrap_api_key="vlm-step-tenant",
            scrape_timeout_s="10",
        )
        orchestrator = start(
            "orchestrator",
            ORCHESTRATOR_TOKEN,
            temporal_target=temporal_server.target,
            task_queue=f"vlm-step-{uuid.uuid4().hex[:8]}",
            scheduler_target=scheduler.grpc_target,
            scheduler_token=SCHEDULER_TOKEN,
            inference_gateway_url=gateway.http_url,
            inference_gateway_token=GATEWAY_TOKEN,
            deploy_vllm_python=str(vllm_python()),
            deploy_poll_s="0.5",
        )
        yield (
            Endpoint(orchestrator.http_url, orchestrator.grpc_target, ORCHESTRATOR_TOKEN),
            Endpoint(gateway.http_url, gateway.grpc_target, GATEWAY_TOKEN),
        )
    finally:
        for proc in reversed(started):
            proc.stop()


@pytest.mark.integration
@pytest.mark.timeout(600)
async def test_deploy_and_ask_through_the_gateway(
    platform: tuple[Endpoint, Endpoint], tmp_path: Path
) -> None:
    """The VLM is a deployment's replica (vLLM through its Transformers backend, placed by the
    scheduler, started by the agent), asked through the gateway, and undeployed after; the trained
    folder is not touched. The language model has heads of 64 (vLLM's CPU attention takes no 16)."""
    orchestrator, gateway = platform
    folder = save_tiny_llava(tmp_path / "trained" / "hf", hidden=256)
    before = sorted(p.name for p in folder.iterdir())
    result = await deploy_and_ask(orchestrator, gateway, folder, "step-40", team="main-job")
    assert result["ok"] is True, result
    # 16 image tokens: (32 / 8)^2 patches, the <image> placeholder expanded by vLLM's processor
    assert result["served_by"] == "shapes-vlm:step-40" and result["image_tokens"] == 16
    assert result["prompt_tokens"] == int(str(result["text_only_prompt_tokens"])) + 16
    assert result["expected"] and isinstance(result["correct"], bool)
    assert str(result["deployment"]).startswith("main-job-vlm (engine vllm): replica job-")
    assert sorted(p.name for p in folder.iterdir()) == before
    async with make_channel(orchestrator.grpc_target, token=ORCHESTRATOR_TOKEN) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)

        async def gone() -> bool:
            try:
                reply = await stub.GetDeployment(
                    orchestrator_pb2.GetDeploymentRequest(name="main-job-vlm"), timeout=10
                )
            except grpc.aio.AioRpcError as exc:
                return exc.code() == grpc.StatusCode.NOT_FOUND
            return reply.deployment.state == "undeployed"

        await eventually(gone, timeout_s=120, interval_s=1.0, what="main-job-vlm undeployed")
