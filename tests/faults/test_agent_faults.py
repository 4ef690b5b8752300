"""A node dies mid-training: its trainer agent and the job's processes are killed with SIGKILL.

Platform: Tansu, Temporal, the scheduler (node loss after 4 s of silence), the orchestrator and
two trainer agents (one simulated GPU each) sharing one object store. A ``training`` workflow
runs a one-replica job with checkpoints every 20 steps. Once a checkpoint is published the node
running the job is killed; afterwards:

- the scheduler marks the node lost and requeues the job, which starts on the other node
  (attempt 2) and resumes from the newest complete checkpoint, not from step 0;
- the workflow completes, counting one infrastructure retry and reporting the final checkpoint;
- no checkpoint step is written twice, and the job ran exactly two attempts;
- the recovery time (kill → the job running again) is printed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fault_platform import (
    ORCHESTRATOR_TOKEN,
    SCHEDULER_TOKEN,
    Platform,
    agent_process,
    start_platform,
    stop_platform,
    wait_ready,
)
from forge.common.v1 import common_pb2
from forge.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from forge.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from google.protobuf import json_format, struct_pb2

from forge_kit.grpckit import make_channel
from forge_kit.testing import ServiceProcess

pytestmark = [pytest.mark.integration, pytest.mark.faults_full, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def training_platform(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Platform, dict[str, ServiceProcess]]]:
    platform = start_platform(
        tmp_path_factory.mktemp("agent-faults"),
        scheduler_env={"FORGE_SCHEDULER_NODE_LOST_AFTER_S": "4", "FORGE_SCHEDULER_HEARTBEAT_INTERVAL_S": "1"},
    )
    agents = {name: agent_process(platform, name).start() for name in ("node-a", "node-b")}
    try:
        yield platform, agents
    finally:
        for agent in agents.values():
            agent.stop()
        stop_platform(platform)


def kill_node(agent: ServiceProcess, job_id: str) -> None:
    """SIGKILL the agent and every process of the job (what losing the machine does)."""
    agent.kill()
    marker = f"FORGE_JOB_ID={job_id}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if marker in environ.split(b"\0"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)


def manifests(root: Path, job_id: str) -> list[int]:
    """Steps of the complete checkpoints written for the job, one entry per manifest file."""
    found = []
    for manifest in (root / "objects").rglob("manifest.json"):
        if job_id in manifest.parts:
            found.append(int(json.loads(manifest.read_text())["step"]))
    return sorted(found)


async def job(stub: scheduler_pb2_grpc.SchedulerServiceAsyncStub, job_id: str) -> scheduler_pb2.Job:
    return (await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id), timeout=10)).job


@pytest.mark.asyncio
async def test_killed_node_mid_training_resumes_elsewhere_from_its_checkpoint(
    training_platform: tuple[Platform, dict[str, ServiceProcess]],
) -> None:
    platform, agents = training_platform
    async with make_channel(platform.scheduler.grpc_target, token=SCHEDULER_TOKEN) as channel:
        scheduler = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        quota = scheduler_pb2.Quota(gpu_type="SIM", guaranteed_gpus=2)
        await scheduler.CreateTeam(scheduler_pb2.CreateTeamRequest(name="faults-train", quotas=[quota]))
        data = struct_pb2.Struct()
        data.update(
            {
                "team": "faults-train",
                "recipe": "smoke",
                "name": "resume-me",
                "overrides": ["max_steps=160", "checkpoint.interval_steps=20", "eval_interval=80"],
                "replicas": 1,
                "gpus_per_replica": 1,
                "gpu_type": "SIM",
                "python": sys.executable,
                "max_infra_retries": 2,
                "timeout_s": 480,
            }
        )
        async with make_channel(platform.orchestrator.grpc_target, token=ORCHESTRATOR_TOKEN) as och:
            orchestrator = orchestrator_pb2_grpc.OrchestratorServiceStub(och)
            started = await orchestrator.StartWorkflow(
                orchestrator_pb2.StartWorkflowRequest(workflow_type="training", input=data), timeout=30
            )
            # The job runs and publishes a first checkpoint.
            job_id = ""
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                got = await orchestrator.GetWorkflow(
                    orchestrator_pb2.GetWorkflowRequest(workflow_id=started.workflow_id), timeout=10
                )
                job_id = job_id or got.progress.fields["job_id"].string_value
                if job_id and manifests(platform.root, job_id):
                    break
                await asyncio.sleep(0.5)
            assert job_id and manifests(platform.root, job_id), "no checkpoint before the fault"
            placed = await job(scheduler, job_id)
            assert placed.state == common_pb2.JOB_STATE_RUNNING and placed.attempt == 1
            [victim] = placed.assigned_nodes
            survivor = "node-b" if victim == "node-a" else "node-a"

            # The node dies.
            kill_node(agents[victim], job_id)
            killed = time.monotonic()
            recovered = None
            while time.monotonic() - killed < 120:
                now = await job(scheduler, job_id)
                if now.attempt == 2 and now.state == common_pb2.JOB_STATE_RUNNING:
                    recovered = time.monotonic() - killed
                    break
                await asyncio.sleep(0.25)
            assert recovered is not None, f"job not running again: {now.state} {now.message}"
            assert list(now.assigned_nodes) == [survivor] and now.preemption_count == 1
            print(f"\nfault trainer-agent kill mid-step: job running again on {survivor} in {recovered:.1f}s")
            agents[victim].start()  # the machine comes back; nothing is sent to it twice
            wait_ready(agents[victim])

            # The workflow finishes with one infrastructure retry and the final checkpoint.
            while True:
                got = await orchestrator.GetWorkflow(
                    orchestrator_pb2.GetWorkflowRequest(workflow_id=started.workflow_id), timeout=10
                )
                if got.status != orchestrator_pb2.WORKFLOW_STATUS_RUNNING:
                    break
                assert time.monotonic() - killed < 480, "training did not finish"
                await asyncio.sleep(1)
    assert got.status == orchestrator_pb2.WORKFLOW_STATUS_COMPLETED, got.error
    result = json_format.MessageToDict(got.result)
    assert result["infra_retries"] == 1 and result["preemptions"] == 0
    checkpoint = result["checkpoint"]
    assert int(checkpoint["step"]) == 160
    steps = manifests(platform.root, job_id)
    assert len(steps) == len(set(steps)), f"a checkpoint step was written twice: {steps}"
    # The second attempt resumed: its log says so and starts after the last checkpoint.
    log = (platform.root / survivor / "runs" / job_id / "attempt-2.log").read_text()
    assert "train.resumed" in log
