"""A sweep survives its orchestrator, its MLflow server and its broker restarting mid-sweep.

Platform: Tansu, Temporal, the scheduler, the orchestrator (its Temporal worker, job-event and
metrics consumer, and the tracking consumer writing to MLflow), a real MLflow tracking server and
one trainer agent with two simulated GPUs. Each scenario starts a ``sweep`` of three trials of the
smoke recipe (a grid over the learning rate, 300 steps, two at a time, ASHA's stopping form with a
rung at step 100), waits until a trial has sent its first ``val_loss``, and then:

1. kill -9s the orchestrator process and starts it again in place;
2. kills the MLflow server and starts it again after a few seconds away;
3. stops the broker and starts it again after a few seconds (memory storage: it comes back
   empty; what was staged meanwhile waits in the services' outboxes).

Afterwards it counts end to end:

- the sweep completes and every trial ends ``completed`` or ``stopped`` (none ``failed`` or
  ``timed_out``: nothing the fault did is charged to a configuration), with its final value;
- every trial's job is finished in the scheduler (succeeded, or cancelled when ASHA stopped it
  before it ran to its end);
- every trial's run is in MLflow, a child of the sweep's parent run, and holds exactly the
  ``loss`` and ``val_loss`` steps its job wrote to ``metrics.jsonl`` — none lost, none twice;
- the ``val_loss`` values the sweep judged are the job's own, in step order, up to where the
  trial ended;
- nothing was dead-lettered by the orchestrator's consumers.

The recovery time (fault → the component serving again) is printed with the counts.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fault_platform import (
    AGENT_TOKEN,
    ORCHESTRATOR_TOKEN,
    SCHEDULER_TOKEN,
    Platform,
    agent_process,
    dead_letters,
    start_platform,
    stop_platform,
    wait_ready,
)
from forge.common.v1 import common_pb2
from forge.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from forge.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from google.protobuf import json_format, struct_pb2

from forge_kit.events import ensure_topics
from forge_kit.grpckit import make_channel
from forge_kit.paths import resolve_data_path
from forge_kit.testing import MlflowServer, ServiceProcess
from forge_orchestrator.tracking.tracker import RunFilter, Tracker

pytestmark = [
    pytest.mark.integration,
    pytest.mark.faults_full,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        not resolve_data_path("corpora/tinyshakespeare/input.txt").is_file(),
        reason="the smoke recipe trains on the tinyshakespeare corpus (forge data fetch)",
    ),
]
NODE = "node-sweep"
MAX_STEPS = 300
SPACE = """
name: faults-{name}
recipe: smoke
metric: {{name: val_loss, mode: min}}
sampler: grid
parameters:
  optim.lr: {{type: categorical, values: [0.003, 0.001, 0.0003]}}
overrides:
  eval_interval: 50
  log_interval: 10
  checkpoint.interval_steps: 100
gpu_type: SIM
budget: {{trials: 3, gpu_hours: 1, max_steps: {max_steps}}}
concurrency: 2
team: {team}
early_stopping: {{rule: asha, min_steps: 100, eta: 3, form: stopping}}
"""


class SweepPlatform:
    def __init__(self, platform: Platform, mlflow: MlflowServer, agent: ServiceProcess) -> None:
        self.platform, self.mlflow, self.agent = platform, mlflow, agent
        self.tracker = Tracker(mlflow.url)


@pytest.fixture(scope="module")
def sweep_platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SweepPlatform]:
    root = tmp_path_factory.mktemp("sweep-faults")
    mlflow = MlflowServer(root / "mlflow", log_path=str(root / "mlflow.log")).start()
    try:
        platform = start_platform(
            root,
            orchestrator_env={
                "FORGE_ORCHESTRATOR_MLFLOW_URI": mlflow.url,
                "FORGE_ORCHESTRATOR_OBJECT_STORE_URL": str(root / "objects"),
                # Metrics the broker lost are read again from the agent's outbox.
                "FORGE_ORCHESTRATOR_TRAINER_AGENT_TOKEN": AGENT_TOKEN,
            },
        )
    except BaseException:
        mlflow.stop()
        raise
    agent = agent_process(platform, NODE, gpus="SIMx2").start()
    try:
        yield SweepPlatform(platform, mlflow, agent)
    finally:
        agent.stop()
        stop_platform(platform)
        mlflow.stop()


def lines_on_node(root: Path) -> int:
    """Metric lines every job on the node has written so far."""
    return sum(len(p.read_text().splitlines()) for p in (root / NODE / "runs").glob("*/metrics.jsonl"))


def written(root: Path, job_id: str) -> list[dict[str, Any]]:
    """The lines the job's training run wrote to its ``metrics.jsonl`` on the node."""
    path = root / NODE / "runs" / job_id / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def _workflow(stub: Any, workflow_id: str) -> orchestrator_pb2.GetWorkflowResponse:
    return await stub.GetWorkflow(orchestrator_pb2.GetWorkflowRequest(workflow_id=workflow_id), timeout=10)


async def run_sweep_through(sp: SweepPlatform, name: str, fault: Callable[[], float]) -> dict[str, Any]:
    """Start a sweep, inject ``fault`` once a trial has sent a ``val_loss``, wait for the sweep's
    end; returns its result with the fault's recovery time under ``recovery_s``."""
    platform = sp.platform
    team = f"faults-sweep-{name}-{uuid.uuid4().hex[:6]}"
    async with make_channel(platform.scheduler.grpc_target, token=SCHEDULER_TOKEN) as channel:
        scheduler = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        quota = scheduler_pb2.Quota(gpu_type="SIM", guaranteed_gpus=2)
        await scheduler.CreateTeam(scheduler_pb2.CreateTeamRequest(name=team, quotas=[quota]))
    data = struct_pb2.Struct()
    data.update(
        {
            "space": SPACE.format(name=name, team=team, max_steps=MAX_STEPS),
            "team": team,
            "python": sys.executable,
        }
    )
    async with make_channel(platform.orchestrator.grpc_target, token=ORCHESTRATOR_TOKEN) as och:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(och)
        started = await stub.StartWorkflow(
            orchestrator_pb2.StartWorkflowRequest(workflow_type="sweep", input=data), timeout=30
        )
        deadline = time.monotonic() + 240
        while True:
            progress = json_format.MessageToDict((await _workflow(stub, started.workflow_id)).progress)
            if any(t.get("values") for t in progress.get("trials", [])):
                break
            assert time.monotonic() < deadline, f"no trial metric before the fault: {progress}"
            await asyncio.sleep(0.3)
    before = lines_on_node(platform.root)
    recovery_s = await asyncio.to_thread(fault)
    # The orchestrator may be the one restarted: a new channel for the wait.
    async with make_channel(platform.orchestrator.grpc_target, token=ORCHESTRATOR_TOKEN) as och:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(och)
        deadline = time.monotonic() + 360
        while (got := await _workflow(stub, started.workflow_id)).status == (
            orchestrator_pb2.WORKFLOW_STATUS_RUNNING
        ):
            assert time.monotonic() < deadline, "the sweep did not finish"
            await asyncio.sleep(1)
    assert got.status == orchestrator_pb2.WORKFLOW_STATUS_COMPLETED, got.error
    result = json_format.MessageToDict(got.result)
    result["recovery_s"] = recovery_s
    # The fault came mid-sweep: the trials went on writing metrics after it.
    result["lines_after_fault"] = lines_on_node(platform.root) - before
    assert result["lines_after_fault"] > 0
    result["workflow_id"] = started.workflow_id
    return result


async def assert_nothing_lost(sp: SweepPlatform, result: dict[str, Any], name: str) -> None:
    platform = sp.platform
    trials = result["trials"]
    states = [t["state"] for t in trials]
    assert len(trials) == 3 and set(states) <= {"completed", "stopped"}, [
        (t["state"], t.get("reason")) for t in trials
    ]
    assert "completed" in states and result.get("bestMetric", result.get("best_metric")) is not None
    async with make_channel(platform.scheduler.grpc_target, token=SCHEDULER_TOKEN) as channel:
        scheduler = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        for trial in trials:
            job = (await scheduler.GetJob(scheduler_pb2.GetJobRequest(job_id=trial["job_id"]))).job
            # A stopped trial's job is cancelled, unless it ran to its end before the cancel came.
            ended = {common_pb2.JOB_STATE_SUCCEEDED}
            if trial["state"] == "stopped":
                ended.add(common_pb2.JOB_STATE_CANCELLED)
            assert job.state in ended, (
                trial["state"],
                common_pb2.JobState.Name(job.state),
            )
    parent = result.get("parent_run_id", "")
    assert parent, "the sweep has no MLflow parent run"
    counts: dict[str, dict[str, int]] = {}
    for trial in trials:
        job_id = trial["job_id"]
        lines = written(platform.root, job_id)
        wrote = {k: [r["step"] for r in lines if k in r] for k in ("loss", "val_loss")}
        # The sweep judged the job's own values, in step order, up to where the trial ended.
        judged = [int(s) for s, _ in trial.get("values", [])]
        assert judged == wrote["val_loss"][: len(judged)] and judged, (job_id, judged, wrote["val_loss"])
        if trial["state"] == "completed":
            assert judged == wrote["val_loss"] and judged[-1] == MAX_STEPS
        # The tracking consumer may still be catching up: wait for the counts, then compare.
        deadline = time.monotonic() + 120
        while True:
            runs = await asyncio.to_thread(sp.tracker.find_runs, RunFilter(job_id=job_id))
            got = {}
            if len(runs) == 1:
                for key in wrote:
                    history = await asyncio.to_thread(sp.tracker.metric_history, runs[0].run_id, key)
                    got[key] = [step for step, _ in history]
            if len(runs) == 1 and all(sorted(got[k]) == wrote[k] for k in wrote):
                break
            assert time.monotonic() < deadline, (
                f"trial {trial['index']}: {len(runs)} runs; MLflow "
                f"{ {k: len(v) for k, v in got.items()} } vs written { {k: len(v) for k, v in wrote.items()} }"
            )
            await asyncio.sleep(1)
        assert runs[0].parent_run_id == parent
        counts[job_id] = {k: len(v) for k, v in got.items()}
    letters = dead_letters(platform.root / "orchestrator" / "orchestrator.db")
    assert letters == [], letters
    steps = sum(c["loss"] + c["val_loss"] for c in counts.values())
    print(
        f"\nfault {name} mid-sweep: recovered in {result['recovery_s']:.1f}s; trials {states}; "
        f"{steps} metric steps in MLflow = written ({result['lines_after_fault']} lines written after "
        f"the fault); ignored metrics {result.get('ignored_metrics', 0)}; "
        f"dead letters 0"
    )


def _restart_process(process: ServiceProcess) -> float:
    process.kill()
    killed = time.monotonic()
    process.start()
    wait_ready(process)
    return time.monotonic() - killed


@pytest.mark.asyncio
async def test_orchestrator_kill_mid_sweep_loses_no_trial_or_metric(sweep_platform: SweepPlatform) -> None:
    result = await run_sweep_through(
        sweep_platform, "orch", lambda: _restart_process(sweep_platform.platform.orchestrator)
    )
    await assert_nothing_lost(sweep_platform, result, "orchestrator kill -9")


@pytest.mark.asyncio
async def test_mlflow_restart_mid_sweep_loses_no_metric(sweep_platform: SweepPlatform) -> None:
    def restart_mlflow() -> float:
        sweep_platform.mlflow.kill()
        killed = time.monotonic()
        time.sleep(5)  # away for a while: metrics keep arriving meanwhile
        sweep_platform.mlflow.start()
        return time.monotonic() - killed

    result = await run_sweep_through(sweep_platform, "mlflow", restart_mlflow)
    await assert_nothing_lost(sweep_platform, result, "mlflow kill")


@pytest.mark.asyncio
async def test_broker_restart_mid_sweep_loses_no_metric(sweep_platform: SweepPlatform) -> None:
    broker = sweep_platform.platform.broker

    def restart_broker() -> float:
        broker.stop()
        stopped = time.monotonic()
        time.sleep(3)  # away for a while: the agent stages metrics meanwhile
        broker.start()
        asyncio.run(ensure_topics(broker.bootstrap))
        return time.monotonic() - stopped

    result = await run_sweep_through(sweep_platform, "broker", restart_broker)
    await assert_nothing_lost(sweep_platform, result, "broker restart")
