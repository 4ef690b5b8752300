"""The ``train`` step of the platform main job (entry-point group ``forge.main_job``).

``forge up`` starts three trainer agents on this machine (one simulated GPU each, standing in for
three nodes: the training job takes two, the main job's vLLM replica one). This step:

1. waits until at least two agents' nodes are registered and ready in the scheduler;
2. makes sure the ``main-job`` team has a quota for their GPUs (an admin action);
3. starts the orchestrator's ``train`` workflow: it submits one job of two replicas × one GPU —
   the scheduler's gang placement puts one replica on each node, each agent launches its replica
   under ``torchrun`` with a c10d rendezvous on loopback (one two-process DDP run over gloo) —
   follows the job's events to SUCCEEDED and waits for its published checkpoint;
4. reports the checkpoint (its Hugging Face export), its validation loss, and text sampled from it.

The result (``checkpoint_uri``, ``run_id``, ``step``, ``checkpoint_id``) is what later steps
(eval) use. The step never imports the CLI or another service, only their contracts.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import grpc
from forge.orchestrator.v1 import orchestrator_pb2
from forge.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from google.protobuf import json_format

from forge_kit.grpckit import make_channel
from forge_kit.mainjob import Endpoint, MainJobContext
from forge_kit.orchestrator_client import OrchestratorClient, status_name

TEAM = "main-job"
GPU_TYPE = "SIM"
NODES = 2
RECIPE = "smoke"
#: 512-token windows: the model's context must hold the ``rag`` step's passages and question.
RECIPE_OVERRIDES = ["max_steps=120", "eval_interval=60", "checkpoint.interval_steps=60", "data.seq_len=512"]
PROMPT = "ROMEO:"
WAIT_NODES_S = 60.0
WAIT_TRAIN_S = 420.0
RPC_S = 15.0


async def train(ctx: MainJobContext) -> dict[str, object]:
    scheduler = ctx.endpoint("scheduler")
    async with make_channel(scheduler.grpc_target, token=scheduler.token) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        # 1. Both nodes.
        nodes = await _wait_for_nodes(stub, NODES)
        # 2. The team and its quota.
        await _ensure_team(stub, sum(len(n.gpus) for n in nodes))
    # 3. The training workflow.
    result = await _run_workflow(
        ctx.endpoint("orchestrator"),
        {
            "team": TEAM,
            "recipe": RECIPE,
            "name": "main-job-train",
            "overrides": RECIPE_OVERRIDES,
            "replicas": NODES,
            "gpus_per_replica": 1,
            "gpu_type": GPU_TYPE,
            "priority_class": "high",
            "python": sys.executable,  # the agents run on this machine, in this environment
            "timeout_s": WAIT_TRAIN_S - 30,
        },
    )
    # 4. Checkpoint, loss and a sample.
    checkpoint = result["checkpoint"]
    hf_dir = Path(checkpoint["uri"])
    sample = await asyncio.to_thread(_sample, hf_dir, PROMPT)
    step = int(checkpoint["step"])
    return {
        "ok": True,
        "workflow_id": result["workflow_id"],
        "job_id": result["job_id"],
        "states_seen": result["states_seen"],
        "run_id": checkpoint["run_id"],
        "step": step,
        "checkpoint_id": f"{checkpoint['run_id']}:step-{step}",
        "checkpoint_uri": str(hf_dir),
        "val_loss": checkpoint.get("metrics", {}).get("val_loss"),
        "sample": sample,
    }


train.order = 40  # type: ignore[attr-defined]
train.timeout_s = WAIT_NODES_S + WAIT_TRAIN_S + 60  # type: ignore[attr-defined]


async def _run_workflow(orchestrator: Endpoint, data: dict[str, Any]) -> dict[str, Any]:
    async with OrchestratorClient(orchestrator.grpc_target, orchestrator.token) as client:
        workflow_id = await client.start("training", data)
        try:
            reply = await client.wait(workflow_id, timeout_s=WAIT_TRAIN_S, poll_s=1.0)
        except TimeoutError:
            raise RuntimeError(
                f"training workflow {workflow_id} still running after {WAIT_TRAIN_S:.0f}s"
            ) from None
    if reply.status != orchestrator_pb2.WORKFLOW_STATUS_COMPLETED:
        raise RuntimeError(
            f"training workflow {workflow_id} ended {status_name(reply.status)}: {reply.error or 'no error given'}"
        )
    result = json_format.MessageToDict(reply.result)
    return {**result, "workflow_id": workflow_id}


async def _wait_for_nodes(
    stub: scheduler_pb2_grpc.SchedulerServiceAsyncStub, count: int
) -> list[scheduler_pb2.Node]:
    deadline = time.monotonic() + WAIT_NODES_S
    while True:
        reply = await stub.ListNodes(scheduler_pb2.ListNodesRequest(), timeout=RPC_S)
        ready = [
            n
            for n in reply.nodes
            if n.state == scheduler_pb2.NODE_STATE_READY and n.gpus and n.gpus[0].type == GPU_TYPE
        ]
        if len(ready) >= count:
            return ready
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{len(ready)} of {count} trainer agents registered within {WAIT_NODES_S:.0f}s"
            )
        await asyncio.sleep(0.5)


async def _ensure_team(stub: scheduler_pb2_grpc.SchedulerServiceAsyncStub, gpus: int) -> None:
    quota = scheduler_pb2.Quota(gpu_type=GPU_TYPE, guaranteed_gpus=gpus, weight=1)
    try:
        await stub.CreateTeam(scheduler_pb2.CreateTeamRequest(name=TEAM, quotas=[quota]), timeout=RPC_S)
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.ALREADY_EXISTS:
            raise
        await stub.SetQuota(scheduler_pb2.SetQuotaRequest(team=TEAM, quota=quota), timeout=RPC_S)


def _sample(hf_dir: Path, prompt: str, new_tokens: int = 60) -> str:
    """Text from the exported checkpoint (seeded sampling, temperature 0.8), whitespace folded."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    inputs = tokenizer(prompt, return_tensors="pt")
    torch.manual_seed(0)
    output = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=True, temperature=0.8, top_k=50)
    return " ".join(str(tokenizer.decode(output[0], skip_special_tokens=True)).split())
