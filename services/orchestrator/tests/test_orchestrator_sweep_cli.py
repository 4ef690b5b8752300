"""``forge sweep`` against a real orchestrator process (with the real scheduler, broker and
Temporal): the front door refuses a bad space naming the field before any job exists; a sweep
starts, its trials wait in the scheduler's queue, ``status`` and ``report`` show it, the
orchestrator is killed and restarted without losing or resubmitting a trial, and ``cancel``
cancels the sweep and its jobs."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from forge.common.v1 import common_pb2
from forge.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from typer.testing import CliRunner

from forge_kit.grpckit import make_channel
from forge_kit.orchestrator_client import OrchestratorClient
from forge_kit.testing import ServiceProcess
from forge_orchestrator.sweep.cli import app

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(180)]
SCHEDULER_TOKEN = "scheduler-test-token"  # the session scheduler's token (conftest)

SPACE = """
name: cli
recipe: smoke
metric: {name: val_loss, mode: min}
parameters:
  optim.lr: {type: categorical, values: [0.003, 0.001]}
gpu_type: SIM
budget: {trials: 2, gpu_hours: 1, max_steps: 9}
concurrency: 2
team: sweep-cli
early_stopping: {rule: asha, min_steps: 1, eta: 3, form: stopping}
"""


def cli(orchestrator: Any, *args: str) -> str:
    result = CliRunner().invoke(
        app,
        [*args, "--target", orchestrator.target],
        env={"FORGE_CLI_ORCHESTRATOR_TOKEN": orchestrator.token},
    )
    assert result.exit_code == 0, result.output
    return result.output


async def _jobs(scheduler: ServiceProcess, job_ids: list[str]) -> list[Any]:
    async with make_channel(scheduler.grpc_target, token=SCHEDULER_TOKEN) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        return [(await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=j))).job for j in job_ids]


async def _start_raw(orchestrator: Any, space: str) -> str:
    async with OrchestratorClient(orchestrator.target, orchestrator.token) as client:
        return await client.start("sweep", {"space": space, "team": "sweep-cli"})


def test_sweep_cli_against_the_orchestrator(
    start_orchestrator: Any, scheduler: ServiceProcess, tmp_path: Path
) -> None:
    orchestrator = start_orchestrator()
    # The front door refuses a bad space itself (a client that skips the CLI's check).
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        asyncio.run(_start_raw(orchestrator, SPACE.replace("optim.lr:", "optim.lrr:")))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input.space.parameters.optim.lrr" in (refused.value.details() or "")
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    sweep_id = cli(orchestrator, "start", str(space)).strip()
    deadline = time.monotonic() + 60
    while True:
        status = json.loads(cli(orchestrator, "status", sweep_id, "--json"))
        if status["trials_by_state"].get("pending") == 2:
            break
        assert time.monotonic() < deadline, status
        time.sleep(0.5)
    assert status["rung_occupancy"] == {"1": 0, "3": 0} and status["best_trial"] is None
    # how far the rungs can be trusted: nothing finished or stopped yet, so nothing to say
    assert status["rung_trust"].startswith("rung 1: Spearman –, Kendall – over 0 finished")
    assert "0 of 0 stopped trials within the noise" in status["rung_trust"]
    assert "trials" in cli(orchestrator, "status", sweep_id)
    cli(orchestrator, "report", sweep_id, "--out", str(tmp_path / "report"))
    assert (tmp_path / "report" / "report.md").read_text().startswith("# Sweep cli")
    view = asyncio.run(_view(orchestrator, sweep_id))
    job_ids = [t["job_id"] for t in view["progress"]["trials"]]
    # The orchestrator is SIGKILLed and started again on its data: the sweep is still there with
    # the same two trials and jobs (none submitted twice), and the new process answers for it.
    orchestrator.process.kill()
    orchestrator = start_orchestrator(like=orchestrator)
    deadline = time.monotonic() + 60
    while True:
        view = asyncio.run(_view(orchestrator, sweep_id))
        if "progress" in view:
            break
        assert time.monotonic() < deadline, view
        time.sleep(0.5)
    assert [t["job_id"] for t in view["progress"]["trials"]] == job_ids
    cli(orchestrator, "cancel", sweep_id)
    deadline = time.monotonic() + 30
    while True:
        jobs = asyncio.run(_jobs(scheduler, job_ids))
        if all(j.state == common_pb2.JOB_STATE_CANCELLED for j in jobs):
            break
        assert time.monotonic() < deadline, [j.state for j in jobs]
        time.sleep(0.5)
    assert all(j.spec.priority_class == "preemptible" and j.spec.team == "sweep-cli" for j in jobs)


async def _view(orchestrator: Any, sweep_id: str) -> dict[str, Any]:
    from forge_kit.orchestrator_client import response_to_dict

    async with OrchestratorClient(orchestrator.target, orchestrator.token) as client:
        return response_to_dict(await client.get(sweep_id))
