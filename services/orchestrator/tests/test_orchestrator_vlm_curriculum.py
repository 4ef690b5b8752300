"""The VLM curriculum workflow on the real Temporal dev server and scheduler: each stage is a
training child whose job events and checkpoint arrive as signals (what the Kafka consumer sends);
the next stage's job must start from the previous stage's manifest."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from forge.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from temporalio.client import Client
from temporalio.worker import Worker

from forge_kit import errors
from forge_kit.grpckit import make_channel
from forge_kit.testing import ServiceProcess, TemporalDevServer, eventually
from forge_orchestrator.activities import SchedulerActivities
from forge_orchestrator.inbox import JOB_EVENT_SIGNAL, PROGRESS_QUERY, JobEvent
from forge_orchestrator.service import build_worker
from forge_orchestrator.training.model import CHECKPOINT_SIGNAL, CheckpointInfo
from forge_orchestrator.vlm_curriculum.model import (
    VlmCurriculumInput,
    VlmCurriculumResult,
    validate_vlm_curriculum,
)

SCHEDULER_TOKEN = "scheduler-test-token"  # the session scheduler's token (conftest)


@pytest.fixture
async def worker(
    temporal_server: TemporalDevServer, scheduler: ServiceProcess
) -> AsyncIterator[tuple[Client, str]]:
    client = await Client.connect(temporal_server.target)
    queue = f"vlm-{uuid.uuid4().hex[:8]}"
    activities = SchedulerActivities(scheduler.grpc_target, SCHEDULER_TOKEN)
    async with build_worker(client, queue, activities, guard=None) as running:
        assert isinstance(running, Worker)
        yield client, queue
    await activities.close()


async def _child_job(client: Client, child_id: str) -> str:
    async def job_id() -> str:
        try:
            return str((await client.get_workflow_handle(child_id).query(PROGRESS_QUERY))["job_id"])
        except Exception:  # noqa: BLE001 - the child may not exist yet
            return ""

    return await eventually(job_id, interval_s=0.1, what=f"{child_id} to submit its job")


async def _finish(client: Client, child_id: str, job_id: str, step: int, preempt: bool = False) -> None:
    handle = client.get_workflow_handle(child_id)
    states = ["PENDING", "RUNNING", *(["PENDING", "RUNNING"] if preempt else []), "SUCCEEDED"]
    for state in states:
        reason = "preempted; back in the queue" if preempt and state == "PENDING" else ""
        await handle.signal(JOB_EVENT_SIGNAL, JobEvent(job_id, state, uuid.uuid4().hex, reason))
    manifest = f"s3://forge/checkpoints/{job_id}/step-{step:08d}/manifest.json"
    await handle.signal(
        CHECKPOINT_SIGNAL,
        CheckpointInfo(
            job_id, job_id, step, f"/runs/{job_id}/hf", manifest, {"val_loss": 1.0}, uuid.uuid4().hex
        ),
    )


async def _command(scheduler: ServiceProcess, job_id: str) -> list[str]:
    async with make_channel(scheduler.grpc_target, token=SCHEDULER_TOKEN) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        return list((await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id))).job.spec.command)


@pytest.mark.integration
@pytest.mark.asyncio
async def test_each_stage_starts_from_the_previous_stages_manifest(
    worker: tuple[Client, str], scheduler: ServiceProcess
) -> None:
    client, queue = worker
    wid = f"{queue}-cur"
    params = VlmCurriculumInput(
        team="research",
        stages=["vlm_align", "vlm_interleave"],
        parent="/models/lm/hf",
        overrides={"vlm_interleave": ["max_steps=5"]},
        gpu_type="H100",
    )
    handle = await client.start_workflow(
        "vlm_curriculum", params, id=wid, task_queue=queue, result_type=VlmCurriculumResult
    )
    first = await _child_job(client, f"{wid}-0-vlm_align")
    assert (await _command(scheduler, first))[-2:] == ["--set", "init.parent=/models/lm/hf"]
    await _finish(client, f"{wid}-0-vlm_align", first, 150, preempt=True)
    second = await _child_job(client, f"{wid}-1-vlm_interleave")
    command = await _command(scheduler, second)
    manifest = f"s3://forge/checkpoints/{first}/step-00000150/manifest.json"
    assert command[command.index("--recipe") + 1] == "vlm_interleave"
    assert [a for a in command if "=" in a] == ["max_steps=5", f"init.parent={manifest}"]
    await _finish(client, f"{wid}-1-vlm_interleave", second, 5)
    result: VlmCurriculumResult = await handle.result()
    assert [s.recipe for s in result.stages] == ["vlm_align", "vlm_interleave"]
    assert result.stages[0].preemptions == 1 and result.stages[1].parent == manifest
    assert result.final_uri == f"/runs/{second}/hf"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"team": ""}, "input.team"),
        ({"stages": []}, "input.stages"),
        ({"stages": ["bad recipe"]}, "input.stages[0]"),
        ({"overrides": {"other": ["a=1"]}}, "input.overrides.other"),
        ({"overrides": {"vlm_align": ["init.parent=x"]}}, "input.overrides.vlm_align[0]"),
        ({"gpu_type": ""}, "input.gpu_type"),
    ],
)
def test_bad_curriculum_input_names_the_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(errors.ValidationError) as caught:
        validate_vlm_curriculum(VlmCurriculumInput(**{"team": "research", "gpu_type": "H100", **change}))
    assert caught.value.field == field
