"""The ``synthetic`` workflow on real processes: the Temporal dev server, the scheduler (with the
session's broker), the programmatic teacher served over HTTP, the inference gateway, and an MLflow
tracking server. The workflow's jobs really run: the test plays the trainer agent and the Kafka
consumer (as ``test_orchestrator_rlhf.py`` does): it runs each job the scheduler holds for the
workflow's children with the job's own command, then signals the job's events and, for the SFT
job, the published checkpoint.

The student is sampled through the gateway, served by a deployment's replica as promotions deploy
a version (``promote_deploy`` on: the synthetic worker's promotion activities start the
``deployment`` workflow, which runs on the main queue's worker here): the replica is a
``JOB_KIND_INFERENCE`` job that a real trainer agent starts (Forge's engine on the tiny student),
in the gateway's pool only while the student is sampled, and drained after. Replicas are placed by
a scheduler of the module's own, with the agent's ``SERVE`` node: on the session's scheduler that
node would also take the stage jobs (they ask no GPU) that the test plays. Each run checks, from
the gateway's pool and its ``forge_gateway_routed_total``, that the replica served every sample.

- ``test_a_tiny_run_generates_verifies_filters_versions_trains_and_evaluates``: every stage on a
  tiny configuration (band [0, 1] keeps what the random student fails); the counts agree from
  stage to stage, the dataset is versioned with its content hash and lineage, the student is
  fine-tuned through the scheduler and evaluated on held-out templates, and the MLflow run has it
  all; the recorded history replays;
- ``test_an_empty_band_ends_the_run_with_the_histogram``: the random student solves nothing, so
  the [0.2, 0.8] band is empty: the run ends ``empty_band`` with a clear message and the pass-rate
  histogram (in the result and in MLflow), and no SFT job is submitted;
- ``test_the_recorded_empty_band_history_replays``: a history recorded by the empty-band test
  (``FORGE_RECORD_HISTORIES=1``) replays against the current workflow code;
- ``test_a_teacher_that_answers_garbage_ends_the_run_with_the_counts``: every teacher answer is
  malformed JSON: the calls are retried and counted, and the run ends ``no_problems`` — it does
  not crash, no job is submitted and no student is deployed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from forge.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from temporalio.client import Client, WorkflowHandle, WorkflowHistory
from temporalio.service import RPCError
from temporalio.worker import Replayer

from forge_kit.grpckit import make_channel
from forge_kit.http import HttpServer
from forge_kit.testing import MlflowServer, ServiceProcess, TemporalDevServer
from forge_kit.testing.tiny_llama import save_tiny_llama
from forge_orchestrator.activities import SchedulerActivities
from forge_orchestrator.deploy.activities import DeployActivities
from forge_orchestrator.deploy.promotion import PromotionActivities, PromotionServing
from forge_orchestrator.deploy.service import DeploymentService
from forge_orchestrator.deploy.workflow import DeploymentWorkflow
from forge_orchestrator.inbox import JOB_EVENT_SIGNAL, PROGRESS_QUERY, JobEvent
from forge_orchestrator.service import build_worker
from forge_orchestrator.synthetic.activities import Endpoint
from forge_orchestrator.synthetic.worker import build_synthetic_worker, synthetic_task_queue
from forge_orchestrator.synthetic.workflow import SYNTHETIC_WORKFLOWS, SyntheticInput, SyntheticResult
from forge_orchestrator.tracking.tracker import RunFilter, Tracker
from forge_orchestrator.training.model import CHECKPOINT_SIGNAL, CheckpointInfo
from forge_training.synthetic.problems import ProgrammaticTeacher
from forge_training.synthetic.teacher import build_app

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(900)]
HISTORIES = Path(__file__).parent / "histories"
SCHEDULER_TOKEN = "scheduler-test-token"  # the session scheduler's token (conftest)
GATEWAY_TOKEN = "synthetic-gateway-token"
TENANT_KEY = "synthetic-tenant-key"
MATH = (
    "Ana has 12 apples and buys 7 more. 12 + 7 = 19. #### 19\n"
    "A pen costs 3 dollars; 5 pens cost 3 * 5 = 15 dollars. #### 15\n"
) * 20


@pytest.fixture(scope="module")
def student(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Llama (512 positions, a tokenizer that has seen digits): the student."""
    root = tmp_path_factory.mktemp("student")
    return save_tiny_llama(root / "student", corpus=[MATH], context=512, vocab_size=320)


@pytest.fixture(scope="module")
def serving(
    start_scheduler: Any,
    start_serving_agent: Any,
    start_serving_gateway: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Any]]:
    """Where replicas run: a scheduler of the module's own, a trainer agent with one ``SERVE``
    GPU, and the inference gateway, whose pool holds only what deployments add."""
    root = tmp_path_factory.mktemp("serving")
    started: list[ServiceProcess] = []
    try:
        scheduler = start_scheduler(root / "scheduler")
        started.append(scheduler)
        started.append(start_serving_agent(scheduler, root / "agent", gpus=1, node="synthetic-serve"))
        gateway = start_serving_gateway(root / "gateway", token=GATEWAY_TOKEN, tenant_key=TENANT_KEY)
        started.append(gateway)
        yield {"root": root, "scheduler": scheduler, "gateway": gateway}
    finally:
        for process in reversed(started):
            process.stop()


class PoolWatch:
    """The deployments' replicas in the gateway's pool, as seen every 0.3 s while a run goes on."""

    def __init__(self, gateway: ServiceProcess) -> None:
        self._url = gateway.http_url
        self.seen: set[str] = set()
        self.before: dict[str, float] = {}

    async def _get(self, path: str) -> httpx.Response:
        headers = {"Authorization": f"Bearer {GATEWAY_TOKEN}"}
        async with httpx.AsyncClient(base_url=self._url, headers=headers, timeout=30) as admin:
            return await admin.get(path)

    async def pool(self) -> set[str]:
        reply = await self._get("/admin/v1/replicas")
        reply.raise_for_status()
        return {r["url"] for r in reply.json()["replicas"] if r.get("source") == "admin"}

    async def watch(self) -> None:
        while True:
            self.seen |= await self.pool()
            await asyncio.sleep(0.3)

    async def routed(self) -> dict[str, float]:
        """``forge_gateway_routed_total`` by replica, since :meth:`watch` started (the gateway
        outlives a run)."""
        text = (await self._get("/metrics")).text
        out: dict[str, float] = {}
        for m in re.finditer(r"^forge_gateway_routed_total\{([^}]*)\} (\S+)$", text, re.MULTILINE):
            replica = re.search(r'replica="([^"]*)"', m.group(1))
            if replica:
                out[replica.group(1)] = out.get(replica.group(1), 0.0) + float(m.group(2))
        return {k: v - self.before.get(k, 0.0) for k, v in out.items() if v > self.before.get(k, 0.0)}


async def serve(app: FastAPI) -> AsyncIterator[str]:
    server = HttpServer(app, "127.0.0.1", 0)
    await server.start()
    try:
        yield f"http://127.0.0.1:{server.port}/v1"
    finally:
        await server.stop()


@pytest.fixture
async def teacher_url() -> AsyncIterator[str]:
    async for url in serve(build_app(ProgrammaticTeacher(seed=0, error_rate=0.3))):
        yield url


def garbage_teacher(calls: list[int]) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        await request.json()
        calls.append(1)
        message = {"role": "assistant", "content": '{"problems": [{"question": '}
        choice = {"index": 0, "message": message, "finish_reason": "length"}
        return JSONResponse(
            {"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice]}
        )

    return app


class Agent:
    """Plays the trainer agent and the event consumer for the workflow's child workflows."""

    SUFFIXES = ("curate", "band", "sft", "heldout")

    def __init__(self, client: Client, scheduler: ServiceProcess, parent: str, runs: Path) -> None:
        self._client, self._scheduler, self._parent, self._runs = client, scheduler, parent, runs
        self.ran: dict[str, str] = {}
        self.logs: dict[str, str] = {}

    async def serve(self) -> None:
        async with make_channel(self._scheduler.grpc_target, token=SCHEDULER_TOKEN) as channel:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
            while True:
                for suffix in self.SUFFIXES:
                    if suffix not in self.ran:
                        await self._try(stub, suffix)
                await asyncio.sleep(0.3)

    async def _try(self, stub: Any, suffix: str) -> None:
        handle = self._client.get_workflow_handle(f"{self._parent}-{suffix}")
        try:
            job_id = str((await handle.query(PROGRESS_QUERY))["job_id"])
        except RPCError:
            return
        if not job_id:
            return
        self.ran[suffix] = job_id
        job = (await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id))).job
        assert job.spec.labels["workflow_id"] == handle.id
        run_dir = self._runs / job_id
        run_dir.mkdir(parents=True)
        await self._event(handle, job_id, "RUNNING")
        process = await asyncio.create_subprocess_exec(
            *job.spec.command,
            cwd=run_dir,
            env={**os.environ, "FORGE_RUN_DIR": str(run_dir), "FORGE_JOB_ID": job_id},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        output, _ = await process.communicate()
        self.logs[suffix] = output.decode(errors="replace")
        if process.returncode:
            tail = self.logs[suffix][-600:]
            await self._event(handle, job_id, "FAILED", f"exited with code {process.returncode}: {tail}")
            return
        await self._event(handle, job_id, "SUCCEEDED")
        if (run_dir / "hf" / "config.json").is_file():
            await handle.signal(
                CHECKPOINT_SIGNAL,
                CheckpointInfo(job_id, job_id, 1, str(run_dir / "hf"), event_id=f"{job_id}-ckpt"),
            )

    @staticmethod
    async def _event(handle: WorkflowHandle[Any, Any], job_id: str, state: str, reason: str = "") -> None:
        await handle.signal(JOB_EVENT_SIGNAL, JobEvent(job_id, state, uuid.uuid4().hex, reason))


async def run_workflow(
    temporal: TemporalDevServer,
    scheduler: ServiceProcess,
    teacher: str,
    serving: dict[str, Any],
    tracker: Tracker,
    params: SyntheticInput,
    runs: Path,
) -> tuple[SyntheticResult, str, Agent, PoolWatch]:
    client = await Client.connect(temporal.target)
    queue = f"synthetic-{uuid.uuid4().hex[:8]}"
    gateway: ServiceProcess = serving["gateway"]
    scheduler_acts = SchedulerActivities(scheduler.grpc_target, SCHEDULER_TOKEN)
    # The deployment workflows' activities reach the scheduler their replicas are placed by.
    replica_acts = SchedulerActivities(serving["scheduler"].grpc_target, SCHEDULER_TOKEN)
    deploys = DeployActivities(
        serving["scheduler"].grpc_target, SCHEDULER_TOKEN, gateway.http_url, GATEWAY_TOKEN
    )
    deployments = DeploymentService(client, queue, forge_python=sys.executable, poll_s=0.5)
    promotions = PromotionActivities(
        deployments,
        PromotionServing(
            team="serving",
            gpu_type="SERVE",
            # Torch's decode attention: no C++ kernel to build before the replica answers.
            engine_args=("torch_threads=1", "num_kv_blocks=64", "decode_attention=torch"),
            layout_dir=str(serving["root"] / "promoted"),
            ready_timeout_s=240.0,
        ),
        gateway_url=gateway.http_url,
        gateway_token=GATEWAY_TOKEN,
    )
    workflow_id = f"{queue}-run"
    agent = Agent(client, scheduler, workflow_id, runs)
    pool = PoolWatch(gateway)
    pool.before = await pool.routed()
    watching = asyncio.create_task(pool.watch())
    try:
        async with (
            build_worker(
                client,
                queue,
                replica_acts,
                workflows=[DeploymentWorkflow],
                extra_activities=deploys.methods(),
                guard=None,
            ),
            build_synthetic_worker(
                client,
                queue,
                scheduler_acts,
                Endpoint(teacher),
                Endpoint(f"{gateway.http_url}/v1", TENANT_KEY),
                tracker,
                promotions,
                guard=None,
            ),
        ):
            handle = await client.start_workflow(
                "synthetic",
                params,
                id=workflow_id,
                task_queue=synthetic_task_queue(queue),
                result_type=SyntheticResult,
            )
            serving_jobs = asyncio.create_task(agent.serve())
            try:
                result: SyntheticResult = await handle.result()
            finally:
                serving_jobs.cancel()
            # A closed workflow's query replays its history on a worker; on a loaded machine the
            # query task can expire first ("context canceled"), so it is asked again.
            for attempt in range(5):
                try:
                    progress = await handle.query(PROGRESS_QUERY)
                    break
                except RPCError:
                    if attempt == 4:
                        raise
                    await asyncio.sleep(2)
            assert progress["step"] == f"done: {result.outcome}"
        history = await handle.fetch_history()
        await Replayer(workflows=list(SYNTHETIC_WORKFLOWS)).replay_workflow(history)
        if os.environ.get("FORGE_RECORD_HISTORIES") == "1":
            (HISTORIES / f"synthetic-{params.band_low:g}-{params.band_high:g}.json").write_text(
                history.to_json()
            )
    finally:
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching
        await scheduler_acts.close()
        await replica_acts.close()
        await deploys.close()
    return result, workflow_id, agent, pool


async def assert_served_by_a_replica(result: SyntheticResult, pool: PoolWatch) -> None:
    """The student's samples came from its deployment's one replica, drained once they were in."""
    student = result.stages["student"]
    assert student["model"].startswith("student:synthetic-") and student["deployment"], student
    assert student["drained"] == [student["deployment"]]
    [replica] = pool.seen  # the deployment's replica was in the gateway's pool
    assert await pool.pool() == set()  # and left it: drained
    routed = await pool.routed()
    # One request a prompt, each routed to the replica (the gateway has no other).
    assert routed.get(replica, 0) >= student["prompts"] > 0, routed
    assert sum(routed.values()) == routed[replica], routed


def tiny_input(student: Path, work: Path, **change: Any) -> SyntheticInput:
    base: dict[str, Any] = {
        "team": "synthetic",
        "work_uri": str(work),
        "student_uri": str(student),
        "student_model": "student",
        "templates": ["add_sub", "unit_price", "percent_off"],
        "heldout_templates": ["bus_stop"],
        "problems": 12,
        "k": 3,
        "seed": 1,
        "samples": 4,
        "student_max_tokens": 24,
        "band_low": 0.0,
        "band_high": 1.0,
        "sft_overrides": ["max_steps=4", "optim.warmup_steps=1", "eval_batches=1", "eval_interval=100",
                          "checkpoint.interval_steps=0", "global_batch_size=4", "micro_batch_size=4"],
        "heldout_problems": 6,
        "python": sys.executable,
        "gpu_type": "H100",
        "checkpoint_wait_s": 30.0,
        "job_timeout_s": 600.0,
    }  # fmt: skip
    return SyntheticInput(**{**base, **change})


def mlflow_run(tracker: Tracker, workflow_id: str) -> Any:
    [run] = tracker.find_runs(RunFilter(workflow_id=workflow_id, role="synthetic"))
    return run


async def test_a_tiny_run_generates_verifies_filters_versions_trains_and_evaluates(
    temporal_server: TemporalDevServer,
    scheduler: ServiceProcess,
    mlflow_server: MlflowServer,
    student: Path,
    serving: dict[str, Any],
    teacher_url: str,
    tmp_path: Path,
) -> None:
    tracker = Tracker(mlflow_server.url)
    params = tiny_input(student, tmp_path / "work")
    result, workflow_id, agent, pool = await run_workflow(
        temporal_server, scheduler, teacher_url, serving, tracker, params, tmp_path / "runs"
    )
    print(f"\nsynthetic run: {json.dumps(result.stages, default=str)}\n{result.message}")
    assert result.outcome == "trained", (result.message, agent.logs)
    assert set(agent.ran) == {"curate", "band", "sft", "heldout"}
    generated = result.stages["generate"]
    assert 0 < generated["problems"] <= 12 and result.teacher["failed_calls"] == 0
    verify, dedup, band = result.stages["verify"], result.stages["dedup"], result.stages["band"]
    print(json.dumps({"verify": verify, "dedup": dedup, "band": band, "histogram": result.histogram}))
    # The teacher planted errors (error rate 0.3): the verifier caught some solutions.
    assert sum(n for status, n in verify["solutions_by_status"].items() if status != "ok") > 0
    assert verify["problems"] == generated["problems"] and dedup["in"] == verify["kept"]
    assert sum(result.histogram.values()) == result.stages["student"]["sampled"] > 0
    await assert_served_by_a_replica(result, pool)
    assert band["kept"] > 0
    dataset = result.dataset
    assert len(dataset["content_hash"]) == 64 and dataset["tokens"] > 0
    lineage = json.loads(Path(dataset["lineage"]).read_text())
    assert lineage["content_hash"] == dataset["content_hash"]
    assert Path(result.checkpoint_uri, "config.json").is_file() and result.sft_job_id == agent.ran["sft"]
    for side in ("base", "tuned"):
        assert 0.0 <= result.heldout[side]["accuracy"] <= 1.0 and result.heldout[side]["n"] == 6
    run = mlflow_run(tracker, workflow_id)
    assert run.status == "FINISHED" and run.tags["forge.outcome"] == "trained"
    assert run.tags["forge.dataset_hash"] == dataset["content_hash"]
    assert run.params["problems"] == "12" and run.metrics["stage/band/kept"] == band["kept"]
    artifacts = tracker.list_artifacts(run.run_id)
    assert {"summary.json", "lineage.json", "pass_rates.png"} <= set(artifacts)
    assert result.run_id == run.run_id and result.run_url.endswith(run.run_id)


async def test_an_empty_band_ends_the_run_with_the_histogram(
    temporal_server: TemporalDevServer,
    scheduler: ServiceProcess,
    mlflow_server: MlflowServer,
    student: Path,
    serving: dict[str, Any],
    teacher_url: str,
    tmp_path: Path,
) -> None:
    tracker = Tracker(mlflow_server.url)
    params = tiny_input(student, tmp_path / "work", band_low=0.2, band_high=0.8, problems=8)
    result, workflow_id, agent, pool = await run_workflow(
        temporal_server, scheduler, teacher_url, serving, tracker, params, tmp_path / "runs"
    )
    print(f"\n{result.message}")
    assert result.outcome == "empty_band", (result.message, agent.logs)
    assert set(agent.ran) == {"curate", "band"}  # no SFT, no eval
    assert "no problem has a pass rate in [0.2, 0.8] over 4 samples" in result.message
    assert sum(result.histogram.values()) == result.stages["student"]["sampled"] > 0
    await assert_served_by_a_replica(result, pool)
    for label, count in result.histogram.items():
        assert f"{label}: {count}" in result.message
    assert not result.dataset and not result.checkpoint_uri
    run = mlflow_run(tracker, workflow_id)
    assert run.status == "FINISHED" and run.tags["forge.outcome"] == "empty_band"
    assert "pass-rate histogram" in run.tags["forge.reason"]
    assert {"summary.json", "pass_rates.png"} <= set(tracker.list_artifacts(run.run_id))
    assert sum(v for k, v in run.metrics.items() if k.startswith("pass_rate/")) == sum(
        result.histogram.values()
    )


async def test_a_teacher_that_answers_garbage_ends_the_run_with_the_counts(
    temporal_server: TemporalDevServer,
    scheduler: ServiceProcess,
    mlflow_server: MlflowServer,
    student: Path,
    serving: dict[str, Any],
    tmp_path: Path,
) -> None:
    tracker = Tracker(mlflow_server.url)
    calls: list[int] = []
    params = tiny_input(student, tmp_path / "work", problems=3, teacher_attempts=2, templates=["add_sub"])
    async for url in serve(garbage_teacher(calls)):
        result, workflow_id, agent, pool = await run_workflow(
            temporal_server, scheduler, url, serving, tracker, params, tmp_path / "runs"
        )
    assert result.outcome == "no_problems" and not agent.ran
    assert not pool.seen and "student" not in result.stages  # no student deployed
    assert result.teacher["malformed"] == 2 == len(calls) and result.teacher["failed_calls"] == 1
    assert "the teacher gave no usable problem" in result.message and "malformed answer" in result.message
    assert mlflow_run(tracker, workflow_id).tags["forge.outcome"] == "no_problems"


async def test_the_recorded_empty_band_history_replays() -> None:
    data = json.loads((HISTORIES / "synthetic-empty-band.json").read_text())
    # Child workflow ids derive from the workflow's: replay under the id it was recorded with.
    child = next(
        e["startChildWorkflowExecutionInitiatedEventAttributes"]["workflowId"]
        for e in data["events"]
        if "startChildWorkflowExecutionInitiatedEventAttributes" in e
    )
    history = WorkflowHistory.from_json(child.removesuffix("-curate"), data)
    assert len(history.events) > 30  # tracking, the teacher, two stage jobs, the student, the record
    result = await Replayer(workflows=list(SYNTHETIC_WORKFLOWS)).replay_workflow(history)
    assert result.replay_failure is None
