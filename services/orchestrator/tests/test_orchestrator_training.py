"""The training workflow on the real Temporal dev server, submitting to the real scheduler: the
job's state changes and its checkpoint arrive as signals (what the Kafka consumer sends), so each
path — success after a preemption, the job's own failure, repeated node loss — is driven exactly."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from forge.common.v1 import common_pb2
from forge.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle
from temporalio.worker import Worker

from forge_kit import errors
from forge_kit.grpckit import make_channel
from forge_kit.testing import ServiceProcess, TemporalDevServer, eventually
from forge_orchestrator.activities import SchedulerActivities
from forge_orchestrator.inbox import JOB_EVENT_SIGNAL, PROGRESS_QUERY, JobEvent
from forge_orchestrator.service import build_worker
from forge_orchestrator.training.model import (
    CHECKPOINT_SIGNAL,
    CheckpointInfo,
    TrainInput,
    TrainResult,
    command_of,
)
from forge_orchestrator.training.service import validate_train

pytestmark = [pytest.mark.integration]
SCHEDULER_TOKEN = "scheduler-test-token"  # the session scheduler's token (conftest)


@pytest.fixture
async def worker(
    temporal_server: TemporalDevServer, scheduler: ServiceProcess
) -> AsyncIterator[tuple[Client, str]]:
    client = await Client.connect(temporal_server.target)
    queue = f"train-{uuid.uuid4().hex[:8]}"
    activities = SchedulerActivities(scheduler.grpc_target, SCHEDULER_TOKEN)
    running: Worker = build_worker(client, queue, activities, guard=None)
    async with running:
        yield client, queue
    await activities.close()


def params(**change: Any) -> TrainInput:
    base = {
        "team": "research",
        "recipe": "smoke",
        "name": "tiny",
        "replicas": 2,
        "gpus_per_replica": 1,
        "gpu_type": "H100",
        "overrides": ["max_steps=20"],
        "checkpoint_wait_s": 30.0,
    }
    return TrainInput(**{**base, **change})


async def start(client: Client, queue: str, data: TrainInput) -> tuple[WorkflowHandle[Any, Any], str]:
    handle = await client.start_workflow(
        "training", data, id=f"{queue}-{uuid.uuid4().hex[:6]}", task_queue=queue, result_type=TrainResult
    )

    async def job_id() -> str:
        return str((await handle.query(PROGRESS_QUERY))["job_id"])

    return handle, await eventually(job_id, interval_s=0.1, what="the workflow to submit its job")


async def send(handle: WorkflowHandle[Any, Any], job_id: str, *states: str, reason: str = "") -> None:
    for state in states:
        await handle.signal(JOB_EVENT_SIGNAL, JobEvent(job_id, state, uuid.uuid4().hex, reason))


async def scheduler_job(scheduler: ServiceProcess, job_id: str) -> scheduler_pb2.Job:
    async with make_channel(scheduler.grpc_target, token=SCHEDULER_TOKEN) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        return (await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id))).job


@pytest.mark.asyncio
async def test_success_after_a_preemption_returns_the_checkpoint(
    worker: tuple[Client, str], scheduler: ServiceProcess
) -> None:
    client, queue = worker
    handle, job_id = await start(client, queue, params())
    job = await scheduler_job(scheduler, job_id)
    assert (job.spec.replicas, job.spec.resources.gpu_count, job.spec.checkpointable) == (2, 1, True)
    assert list(job.spec.command[1:5]) == ["-m", "forge_training.run", "--recipe", "smoke"]
    assert job.spec.labels["workflow_id"] == handle.id
    await send(handle, job_id, "PENDING", "SCHEDULED", "RUNNING")
    await send(handle, job_id, "PENDING", reason="preempted on node-a (grace over); back in the queue")
    await send(handle, job_id, "SCHEDULED", "RUNNING", "SUCCEEDED")
    await handle.signal(
        CHECKPOINT_SIGNAL,
        CheckpointInfo(job_id, "run-1", 20, "/runs/hf", metrics={"val_loss": 4.2}, event_id="c1"),
    )
    result: TrainResult = await handle.result()
    assert (result.job_id, result.preemptions, result.infra_retries) == (job_id, 1, 0)
    assert result.checkpoint is not None and (result.checkpoint.step, result.checkpoint.uri) == (
        20,
        "/runs/hf",
    )
    assert result.states_seen[-1] == "SUCCEEDED"


@pytest.mark.asyncio
async def test_the_jobs_own_failure_fails_fast_without_retry(worker: tuple[Client, str]) -> None:
    client, queue = worker
    handle, job_id = await start(client, queue, params())
    await send(handle, job_id, "PENDING", "RUNNING")
    await send(
        handle, job_id, "FAILED", reason="replica on node-a failed: exited with code 1: ZeroDivisionError"
    )
    with pytest.raises(WorkflowFailureError) as caught:
        await handle.result()
    assert "ZeroDivisionError" in str(caught.value.cause)


@pytest.mark.asyncio
async def test_repeated_node_loss_exhausts_the_bounded_retries_and_cancels_the_job(
    worker: tuple[Client, str], scheduler: ServiceProcess
) -> None:
    client, queue = worker
    handle, job_id = await start(client, queue, params(max_infra_retries=1))
    lost = "node node-a lost; requeued"
    await send(handle, job_id, "PENDING", "RUNNING")
    await send(handle, job_id, "PENDING", reason=lost)
    await send(handle, job_id, "RUNNING")
    await send(handle, job_id, "PENDING", reason=lost)
    with pytest.raises(WorkflowFailureError) as caught:
        await handle.result()
    assert "lost its node 2 times" in str(caught.value.cause)
    assert (await scheduler_job(scheduler, job_id)).state == common_pb2.JOB_STATE_CANCELLED


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"recipe": "has space"}, "input.recipe"),
        ({"overrides": ["no-equals"]}, "input.overrides[0]"),
        ({"replicas": 0}, "input.replicas"),
        ({"timeout_s": 0}, "input.timeout_s"),
    ],
)
def test_bad_training_input_names_the_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(errors.ValidationError) as caught:
        validate_train(params(**change))
    assert caught.value.field == field


def test_command_runs_the_training_entry_point_with_overrides() -> None:
    assert command_of(params(python="/venv/bin/python")) == [
        "/venv/bin/python",
        "-m",
        "forge_training.run",
        "--recipe",
        "smoke",
        "--set",
        "max_steps=20",
    ]
