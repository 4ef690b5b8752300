"""The ``vlm`` step of the platform main job (entry-point group ``forge.main_job``; order 95, after
every text step): a chat completion with an image, through the gateway, about a generated scene.

1. **Train** a vision-language model through the platform's training path: the orchestrator's
   ``training`` workflow runs the ``vlm_joint`` recipe (one stage: captions, interleaved documents
   and VQA chats of the synthetic shapes world, text replay) on one simulated GPU, its language
   model initialised from the ``train`` step's checkpoint, for :data:`MAX_STEPS` steps — a run
   sized for the main job's minutes, not for accuracy (the curriculum's figures are
   ``forge bench vlm``'s; ``vlm.from_scratch=false``: the LM keeps the parent's weights); the
   trainer exports it as a LLaVA folder.
2. **Serve** it: load the folder into the model server (``POST /admin/v1/models`` as
   :data:`MODEL_NAME` at ``step-<n>``), make sure the gateway routes to that model server, and
   wait until the gateway's ``/v1/models`` lists it.
3. **Ask**: render a scene of the shapes world (:mod:`forge_training.vlm.world`, a held-out
   question template), send it as an ``image_url`` data URI with the question through the
   gateway with the ``openai`` SDK, and report the answer next to the scene's true answer, and
   the usage (its ``prompt_tokens_details.image_tokens`` shows the image reached the model).

The step succeeds when the answer came back through the gateway from the trained version with the
image counted in its usage; whether a model trained for seconds answers *correctly* is reported
(``correct``), not required.
"""

from __future__ import annotations

import asyncio
import base64
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai

from forge_kit.mainjob import Endpoint, MainJobContext
from forge_trainer_agent.main_job import GPU_TYPE, TEAM, _run_workflow

RECIPE = "vlm_joint"
MAX_STEPS = 40
MODEL_NAME = "shapes-vlm"
MODEL_HEADER = "x-forge-model"
#: The scene asked about: the first held-out-template question of this seed.
SCENE_SEED = 7
WAIT_GATEWAY_S = 45.0
HTTP_S = 120.0


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
    asked = await serve_and_ask(
        ctx.endpoint("model_server"), ctx.endpoint("inference_gateway"), folder, MODEL_NAME, f"step-{step}"
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
vlm.timeout_s = 600.0  # type: ignore[attr-defined]


async def serve_and_ask(
    server: Endpoint, gateway: Endpoint, folder: Path, name: str, version: str
) -> dict[str, object]:
    """Load ``folder`` as ``name:version`` on the model server, route the gateway to it, and ask
    about a generated scene through the gateway (steps 2 and 3 of the module docstring)."""
    async with httpx.AsyncClient(timeout=HTTP_S) as client:
        reply = await client.post(
            f"{server.http_url}/admin/v1/models",
            json={"name": name, "path": str(folder), "version": version},
            headers=_bearer(server.token),
        )
        _expect(reply, {201}, f"loading {folder} into the model server as {name}:{version}")
        reply = await client.post(
            f"{gateway.http_url}/admin/v1/replicas",
            json={"url": server.http_url, "token": server.token},
            headers=_bearer(gateway.token),
        )
        _expect(reply, {201, 409}, f"adding {server.http_url} to the gateway's replicas")
        waited = await _wait_listed(client, gateway, name, version)
    png, question, expected, qtype = await asyncio.to_thread(scene_question)
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    async with openai.AsyncOpenAI(
        base_url=f"{gateway.http_url}/v1", api_key=gateway.token, max_retries=0, timeout=HTTP_S
    ) as sdk:
        raw = await sdk.chat.completions.with_raw_response.create(
            model=f"{name}:{version}",
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": uri}},
                        {"type": "text", "text": question},
                    ],
                }
            ],
            max_tokens=8,
            temperature=0,
            stop=["\n"],
        )
    completion = raw.parse()
    answer = (completion.choices[0].message.content or "").strip()
    usage = completion.usage
    details = usage.prompt_tokens_details.model_dump() if usage and usage.prompt_tokens_details else {}
    image_tokens = int(details.get("image_tokens") or 0)
    from forge_training.vlm.metrics import exact_match

    served_by = raw.headers.get(MODEL_HEADER, "")
    return {
        "ok": bool(
            usage and usage.completion_tokens > 0 and image_tokens > 0 and served_by == f"{name}:{version}"
        ),
        "model": f"{name}:{version}",
        "served_by": served_by,
        "gateway_saw_model_after_s": round(waited, 2),
        "image_bytes": len(png),
        "question": question,
        "question_type": qtype,
        "expected": expected,
        "answer": answer,
        "correct": bool(exact_match(answer, expected)),
        "prompt_tokens": usage.prompt_tokens if usage else 0,
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
                f"the gateway did not list {name}:{version} within {WAIT_GATEWAY_S:.0f}s "
                f"(its /v1/models: HTTP {reply.status_code} {reply.text[:500]})"
            )
        await asyncio.sleep(0.5)


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _expect(reply: httpx.Response, statuses: set[int], doing: str) -> None:
    if reply.status_code not in statuses:
        raise VlmStepError(f"{doing}: HTTP {reply.status_code}: {reply.text[:500]}")
