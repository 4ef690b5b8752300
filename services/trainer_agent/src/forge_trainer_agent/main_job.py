"""The ``train`` step of the platform main job (entry-point group ``forge.main_job``).

``forge up`` starts two trainer agents on this machine (one simulated GPU each, standing in for
two nodes). This step:

1. waits until both agents' nodes are registered and ready in the scheduler;
2. makes sure the ``main-job`` team has a quota for their GPUs;
3. submits one training job of two replicas × one GPU — the scheduler's gang placement puts one
   replica on each node, and each agent launches its replica under ``torchrun`` with a c10d
   rendezvous on loopback (one two-process DDP run over gloo);
4. watches the job to SUCCEEDED (any other end fails the step with the scheduler's message);
5. reads the published checkpoint from the rank-0 agent (``ListRuns``), its validation loss
   from the run's metrics, and samples text from the exported Hugging Face checkpoint.

The result (``checkpoint_uri``, ``run_id``, ``step``, ``checkpoint_id``) is what later steps
(eval) use. The step never imports the CLI (services do not depend on it).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Protocol

import grpc
from forge.common.v1 import common_pb2
from forge.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from forge.trainer.v1 import trainer_pb2, trainer_pb2_grpc

from forge_kit.grpckit import make_channel

TEAM = "main-job"
GPU_TYPE = "SIM"
AGENTS = ("trainer_agent", "trainer_agent_2")
RECIPE_OVERRIDES = ("max_steps=40", "eval_interval=20", "checkpoint.interval_steps=20")
PROMPT = "ROMEO:"
WAIT_NODES_S = 60.0
WAIT_JOB_S = 360.0
RPC_S = 15.0


class Endpoint(Protocol):
    @property
    def grpc_target(self) -> str: ...

    @property
    def token(self) -> str: ...


class MainJobContext(Protocol):
    """The part of ``forge_cli.mainjob.MainJobContext`` this step uses."""

    def endpoint(self, name: str) -> Endpoint: ...


async def train(ctx: MainJobContext) -> dict[str, object]:
    scheduler = ctx.endpoint("scheduler")
    async with make_channel(scheduler.grpc_target, token=scheduler.token) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        # 1. Both nodes.
        nodes = await _wait_for_nodes(stub, len(AGENTS))
        # 2. The team and its quota.
        await _ensure_team(stub, sum(len(n.gpus) for n in nodes))
        # 3. One job, two replicas.
        spec = scheduler_pb2.JobSpec(
            name="main-job-train",
            team=TEAM,
            priority_class="high",
            kind=scheduler_pb2.JOB_KIND_TRAINING,
            resources=common_pb2.ResourceRequest(gpu_count=1, gpu_type=GPU_TYPE),
            replicas=len(AGENTS),
            placement=scheduler_pb2.PLACEMENT_ANY,
            checkpointable=True,
            command=[
                sys.executable,  # the platform's interpreter: the agents run on this machine
                "-m",
                "forge_trainer_agent.training.run",
                "--recipe",
                "smoke",
                *(arg for pair in RECIPE_OVERRIDES for arg in ("--set", pair)),
            ],
            labels={"purpose": "main-job"},
        )
        submitted = await stub.SubmitJob(
            scheduler_pb2.SubmitJobRequest(spec=spec, request_id=f"main-job-train-{uuid.uuid4().hex}"),
            timeout=RPC_S,
        )
        # 4. Until it ends.
        job = await _wait_for_end(stub, submitted.job.id)
    if job.state != common_pb2.JOB_STATE_SUCCEEDED:
        state = common_pb2.JobState.Name(job.state)
        raise RuntimeError(f"training job {job.id} ended {state}: {job.message}")
    # 5. Checkpoint, loss and a sample.
    run = await _published_run(ctx, job.id)
    hf_dir = Path(run.last_checkpoint.export_uri)
    val_loss = _last_metric(hf_dir.parent / "metrics.jsonl", "val_loss")
    sample = await asyncio.to_thread(_sample, hf_dir, PROMPT)
    return {
        "ok": True,
        "job_id": job.id,
        "nodes": list(job.assigned_nodes),
        "run_id": run.run_id,
        "step": run.last_checkpoint.step,
        "checkpoint_id": f"{run.run_id}:step-{run.last_checkpoint.step}",
        "checkpoint_uri": str(hf_dir),
        "val_loss": val_loss,
        "sample": sample,
    }


train.order = 40  # type: ignore[attr-defined]
train.timeout_s = WAIT_NODES_S + WAIT_JOB_S + 60  # type: ignore[attr-defined]


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


async def _wait_for_end(stub: scheduler_pb2_grpc.SchedulerServiceAsyncStub, job_id: str) -> scheduler_pb2.Job:
    terminal = {common_pb2.JOB_STATE_SUCCEEDED, common_pb2.JOB_STATE_FAILED, common_pb2.JOB_STATE_CANCELLED}
    deadline = time.monotonic() + WAIT_JOB_S
    while True:
        job = (await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id), timeout=RPC_S)).job
        if job.state in terminal:
            return job
        if time.monotonic() > deadline:
            raise RuntimeError(f"training job {job_id} not done within {WAIT_JOB_S:.0f}s: {job.message}")
        await asyncio.sleep(1.0)


async def _published_run(ctx: MainJobContext, job_id: str) -> trainer_pb2.Run:
    """The run of ``job_id`` with a published checkpoint, from whichever agent ran rank 0."""
    for name in AGENTS:
        agent = ctx.endpoint(name)
        async with make_channel(agent.grpc_target, token=agent.token) as channel:
            stub = trainer_pb2_grpc.TrainerAgentServiceStub(channel)
            reply = await stub.ListRuns(trainer_pb2.ListRunsRequest(job_id=job_id), timeout=RPC_S)
        for run in reply.runs:
            if run.HasField("last_checkpoint") and run.last_checkpoint.export_uri:
                return run
    raise RuntimeError(f"no agent published a checkpoint for job {job_id}")


def _last_metric(path: Path, key: str) -> float | None:
    value = None
    if path.exists():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if key in record:
                value = float(record[key])
    return value


def _sample(hf_dir: Path, prompt: str, new_tokens: int = 40) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    inputs = tokenizer(prompt, return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
    return str(tokenizer.decode(output[0], skip_special_tokens=True))
