"""The RLHF workflow on the real Temporal dev server with the real scheduler, preference-feedback
service and (for the hand-over) eval service as processes, and real training.

Raters answer comparisons over the feedback service's gRPC API: two honest raters and an
adversarial one, whom rater quality flags and the snapshot leaves out. The test plays the
trainer agent and the Kafka consumer: it runs each job the scheduler holds for the loop's child
workflows exactly as an agent would (the job's own command, with ``FORGE_RUN_DIR`` and
``FORGE_JOB_ID``), then signals the job's events and, for training jobs, the published
checkpoint — what the consumer does on ``JobStateChanged`` and ``CheckpointPublished``.

- ``test_a_reward_model_that_does_not_beat_chance_stops_the_loop``: real HH-RLHF labels, a tiny
  reward model trained for a few steps: held-out accuracy is not significantly above 50 %, so
  the version is registered, retired, and the round is rejected with the reason.
- ``test_a_round_trains_evaluates_optimises_and_hands_over``: HH-RLHF pairs relabelled by a rule a
  tiny model learns in seconds (the raters prefer the response that ends with a full stop); the
  reward model passes the gate, DPO runs against the reference, the drift check scores it, and
  the checkpoint is promoted by eval-and-promote.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gzip
import json
import os
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from forge.common.v1 import common_pb2
from forge.feedback.v1 import feedback_pb2, feedback_pb2_grpc
from forge.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError
from temporalio.worker import Replayer

from forge_kit.grpckit import make_channel
from forge_kit.http import HttpServer
from forge_kit.paths import data_dir
from forge_kit.testing import ServiceProcess, TemporalDevServer, base_env
from forge_orchestrator.activities import SchedulerActivities
from forge_orchestrator.eval_activities import EvalActivities
from forge_orchestrator.inbox import JOB_EVENT_SIGNAL, PROGRESS_QUERY, JobEvent
from forge_orchestrator.main_job.rlhf import RLHF_SIZES
from forge_orchestrator.rlhf.activities import RlhfActivities
from forge_orchestrator.rlhf.sampling import RlhfSampler
from forge_orchestrator.rlhf.worker import build_rlhf_worker, rlhf_task_queue
from forge_orchestrator.rlhf.workflow import RLHF_WORKFLOWS, RlhfInput, RlhfResult
from forge_orchestrator.routing import AUTO_EVAL_LABEL
from forge_orchestrator.training.model import CHECKPOINT_SIGNAL, CheckpointInfo

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
SCHEDULER_TOKEN = "scheduler-test-token"  # the session scheduler's token (conftest)
FEEDBACK_TOKEN = "feedback-test-token"
EVAL_TOKEN = "eval-test-token"
DATA = data_dir()
HH = DATA / "preferences" / "hh-rlhf"
PAIR_SETTINGS = ["optim.warmup_steps=2", "eval_batches=2", "eval_interval=100", "checkpoint.interval_steps=0"]
CHOICE = {"A": common_pb2.PREFERENCE_CHOICE_A, "B": common_pb2.PREFERENCE_CHOICE_B}
FLIP = {"A": "B", "B": "A"}
MAIN_JOB_PAIRS = 144
"""Accepted pairs the main job's simulated raters post (``forge_preference_feedback.main_job``)."""


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny pre-trained policy (the trainer's ``smoke`` recipe): the loop's reference."""
    run = tmp_path_factory.mktemp("policy")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "forge_training.run",
            "--recipe",
            "smoke",
            "--run-dir",
            str(run),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return run / "hf"


def _last_turn(transcript: str) -> str:
    return transcript.rsplit("\n\nAssistant:", 1)[-1].strip()


def period_rule_seed(root: Path, limit: int) -> Path:
    """HH-RLHF pairs where exactly one response ends with a full stop, that one marked chosen."""
    out = root / "period-rule" / "helpful-base"
    out.mkdir(parents=True)
    kept = 0
    with (
        gzip.open(HH / "helpful-base" / "test.jsonl.gz", "rt") as source,
        gzip.open(out / "test.jsonl.gz", "wt") as sink,
    ):
        for line in source:
            row = json.loads(line)
            a, b = _last_turn(row["chosen"]), _last_turn(row["rejected"])
            if a.endswith(".") == b.endswith("."):
                continue
            chosen, rejected = (
                (row["chosen"], row["rejected"]) if a.endswith(".") else (row["rejected"], row["chosen"])
            )
            sink.write(json.dumps({"chosen": chosen, "rejected": rejected}) + "\n")
            kept += 1
            if kept == limit:
                break
    return out.parent


@dataclass
class Feedback:
    process: ServiceProcess
    data: Path

    def gold(self) -> dict[str, str]:
        with sqlite3.connect(self.data / "preference_feedback.db") as conn:
            return dict(conn.execute("SELECT id, gold_choice FROM feedback_comparisons"))


def start_feedback(data: Path, seed_dir: Path, limit: int) -> Feedback:
    process = ServiceProcess(
        "forge_preference_feedback",
        env=base_env(
            "preference_feedback",
            token=FEEDBACK_TOKEN,
            data_dir=data,
            seed_dir=str(seed_dir),
            seed_limit=str(limit),
            quality_min_median_seconds="0",
        ),
        log_path=str(data / "feedback.log"),
    )
    process.start()
    return Feedback(process, data)


async def rate(feedback: Feedback, rater: str, count: int, *, adversarial: bool = False) -> int:
    """``rater`` answers up to ``count`` comparisons over gRPC: the gold side, or the other one."""
    gold = feedback.gold()
    answered = 0
    async with make_channel(feedback.process.grpc_target, token=FEEDBACK_TOKEN) as channel:
        stub = feedback_pb2_grpc.PreferenceFeedbackServiceStub(channel)
        while answered < count:
            reply = await stub.GetNextComparison(feedback_pb2.GetNextComparisonRequest(rater_id=rater))
            if not reply.HasField("comparison"):
                break
            side = gold[reply.comparison.id]
            await stub.SubmitPreference(
                feedback_pb2.SubmitPreferenceRequest(
                    comparison_id=reply.comparison.id,
                    rater_id=rater,
                    choice=CHOICE[FLIP[side] if adversarial else side],
                    confidence=0.9,
                )
            )
            answered += 1
    return answered


async def preference_stats(feedback: Feedback) -> feedback_pb2.GetPreferenceStatsResponse:
    async with make_channel(feedback.process.grpc_target, token=FEEDBACK_TOKEN) as channel:
        stub = feedback_pb2_grpc.PreferenceFeedbackServiceStub(channel)
        return await stub.GetPreferenceStats(feedback_pb2.GetPreferenceStatsRequest())


async def rounds_of(feedback: Feedback, workflow_id: str) -> list[feedback_pb2.RlhfRound]:
    async with make_channel(feedback.process.grpc_target, token=FEEDBACK_TOKEN) as channel:
        stub = feedback_pb2_grpc.PreferenceFeedbackServiceStub(channel)
        reply = await stub.ListRlhfRounds(feedback_pb2.ListRlhfRoundsRequest(workflow_id=workflow_id))
    return list(reply.rounds)


async def reward_model(feedback: Feedback, ref: str) -> feedback_pb2.RewardModel:
    name, _, version = ref.partition(":")
    async with make_channel(feedback.process.grpc_target, token=FEEDBACK_TOKEN) as channel:
        stub = feedback_pb2_grpc.PreferenceFeedbackServiceStub(channel)
        reply = await stub.GetRewardModel(
            feedback_pb2.GetRewardModelRequest(ref=common_pb2.ModelRef(name=name, version=version))
        )
    return reply.reward_model


class Agent:
    """Plays the trainer agent and the event consumer for the loop's child workflows."""

    SUFFIXES = ("r1-rm", "r1-rm-eval", "r1-dpo", "r1-check")

    def __init__(self, client: Client, scheduler: ServiceProcess, parent: str, runs: Path) -> None:
        self._client, self._scheduler, self._parent, self._runs = client, scheduler, parent, runs
        self.ran: dict[str, str] = {}
        """child workflow suffix → job id it ran."""

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
        # The loop's training jobs keep the checkpoint handler from evaluating their checkpoints.
        assert job.spec.labels.get(AUTO_EVAL_LABEL) == ("false" if suffix in ("r1-rm", "r1-dpo") else None)
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
        (run_dir / "job.log").write_bytes(output)
        if process.returncode:
            tail = output.decode(errors="replace")[-400:]
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


def scripted_endpoint() -> FastAPI:
    """An OpenAI-compatible endpoint that answers every question with 42."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "policy-rlhf"}]}

    @app.post("/v1/completions")
    async def completions(body: dict[str, Any]) -> dict[str, Any]:
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        choices = [{"index": i, "text": " #### 42", "finish_reason": "stop"} for i in range(len(prompts))]
        return {"object": "text_completion", "model": body["model"], "choices": choices}

    @app.post("/v1/chat/completions")
    async def chat(body: dict[str, Any]) -> dict[str, Any]:
        message = {"role": "assistant", "content": " #### 42"}
        return {
            "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        }

    return app


@pytest.fixture
def eval_service(tmp_path: Path) -> Iterator[ServiceProcess]:
    data = tmp_path / "eval"
    data.mkdir()
    process = ServiceProcess(
        "forge_eval",
        env=base_env("eval", token=EVAL_TOKEN, data_dir=data, benchmarks_dir=str(DATA / "benchmarks")),
        log_path=str(data / "eval.log"),
    ).start()
    yield process
    process.stop()


@pytest.fixture
async def endpoint() -> AsyncIterator[str]:
    server = HttpServer(scripted_endpoint(), "127.0.0.1", 0)
    await server.start()
    yield f"http://127.0.0.1:{server.port}"
    await server.stop()


async def run_loop(
    temporal: TemporalDevServer,
    scheduler: ServiceProcess,
    feedback: Feedback,
    eval_target: str,
    params: RlhfInput,
    runs: Path,
    *,
    buffering: asyncio.Event | None = None,
) -> tuple[RlhfResult, str, Agent]:
    """Run the loop to its end. ``buffering`` is set once the workflow has counted the pairs and
    gone to sleep until its next count (its progress query says it is buffering)."""
    client = await Client.connect(temporal.target)
    queue = f"rlhf-{uuid.uuid4().hex[:8]}"
    scheduler_acts = SchedulerActivities(scheduler.grpc_target, SCHEDULER_TOKEN)
    evals = EvalActivities(eval_target, EVAL_TOKEN)
    rlhf = RlhfActivities(feedback.process.grpc_target, FEEDBACK_TOKEN)
    workflow_id = f"{queue}-loop"
    agent = Agent(client, scheduler, workflow_id, runs)
    try:
        async with build_rlhf_worker(
            client, queue, scheduler_acts, evals, rlhf, RlhfSampler("", "", "", "", ""), guard=None
        ):
            handle = await client.start_workflow(
                "rlhf", params, id=workflow_id, task_queue=rlhf_task_queue(queue), result_type=RlhfResult
            )
            serving = asyncio.create_task(agent.serve())
            if buffering is not None:
                while "buffering" not in str((await handle.query(PROGRESS_QUERY))["step"]):
                    await asyncio.sleep(0.1)
                buffering.set()
            try:
                result: RlhfResult = await handle.result()
            finally:
                serving.cancel()
            progress = await handle.query(PROGRESS_QUERY)
            assert progress["step"] == "done" and len(progress["rounds"]) == len(result.rounds)
        # The recorded history replays against the workflow code (determinism).
        await Replayer(workflows=list(RLHF_WORKFLOWS)).replay_workflow(await handle.fetch_history())
    finally:
        for closer in (scheduler_acts.close, evals.close, rlhf.close):
            await closer()
    return result, workflow_id, agent


def loop_input(policy: Path, work: Path, **change: Any) -> RlhfInput:
    base: dict[str, Any] = {
        "policy_uri": str(policy),
        "work_uri": str(work),
        "min_new_pairs": 30,
        "heldout_fraction": 0.35,
        "poll_s": 0.5,
        "max_poll_s": 2.0,
        "python": sys.executable,
        "gpu_type": "H100",
        "checkpoint_wait_s": 30.0,
        "reward_overrides": ["max_steps=12", *PAIR_SETTINGS],
        "dpo_overrides": ["max_steps=10", "optim.lr=1e-3", *PAIR_SETTINGS],
        "check_max_prompts": 6,
        "check_max_new_tokens": 12,
        "promote": False,
    }
    return RlhfInput(**{**base, **change})


@pytest.mark.asyncio
async def test_a_reward_model_that_does_not_beat_chance_stops_the_loop(
    temporal_server: TemporalDevServer, scheduler: ServiceProcess, policy: Path, tmp_path: Path
) -> None:
    feedback = start_feedback(tmp_path / "feedback", HH, limit=40)
    try:
        # Too few pairs at first: the loop counts 10 and buffers. Mallory answers before bob and is
        # flagged at once (her answers contradict alice's on the same comparisons), so the accepted
        # count reaches the loop's 80 only with bob's last answer, whenever the loop counts: the
        # snapshot holds every answer below.
        assert await rate(feedback, "alice", 10) == 10
        buffering = asyncio.Event()
        loop = asyncio.create_task(
            run_loop(
                temporal_server,
                scheduler,
                feedback,
                "127.0.0.1:1",
                loop_input(policy, tmp_path / "work", min_new_pairs=80, poll_s=5.0, max_poll_s=10.0),
                tmp_path / "runs",
                buffering=buffering,
            )
        )
        await asyncio.wait_for(buffering.wait(), timeout=60)
        assert not loop.done()
        await rate(feedback, "alice", 30)
        assert await rate(feedback, "mallory", 15, adversarial=True) == 15
        stats = await preference_stats(feedback)
        assert (stats.accepted_pairs, set(stats.excluded_raters)) == (40, {"mallory"})
        await rate(feedback, "bob", 40)
        result, workflow_id, agent = await loop
        [record] = result.rounds
        registered = await reward_model(feedback, record.reward_model)
        [row] = await rounds_of(feedback, workflow_id)
    finally:
        feedback.process.stop()

    print(f"\nrefused round: {json.dumps(dataclasses.asdict(record), default=str)}")
    assert set(agent.ran) == {"r1-rm", "r1-rm-eval"}  # no policy round after the refusal
    assert record.status == "rejected" and record.new_pairs >= 60
    assert "mallory" in record.excluded_raters and "alice" not in record.excluded_raters
    # The snapshot left mallory out and holds alice's and bob's 80 answers.
    snapshot = Path(record.snapshot_uri)
    manifest = json.loads((snapshot / "manifest.json").read_text())
    assert manifest["snapshot_id"] == record.snapshot_id == snapshot.name
    assert manifest["train_pairs"] + manifest["test_pairs"] == 80
    assert manifest["excluded"]["flagged_rater"] == 15
    # The version is registered with its figures and snapshot, and retired; the reason says why.
    assert record.rm_ci95_low <= 0.5 < record.rm_ci95_high
    assert 0 < record.rm_n <= manifest["test_pairs"]
    assert "does not beat 50% significantly" in record.reason and record.reward_model in record.reason
    assert registered.snapshot_id == record.snapshot_id and registered.heldout.n == record.rm_n
    assert registered.heldout.ci95_low == pytest.approx(record.rm_ci95_low)
    assert registered.status == feedback_pb2.REWARD_MODEL_STATUS_RETIRED
    assert (row.status, row.reason, row.snapshot_id) == ("rejected", record.reason, record.snapshot_id)
    assert row.metrics["rm_accuracy"] == pytest.approx(record.rm_accuracy)
    assert result.ended == record.reason and result.policy_uri == str(policy)


@pytest.mark.asyncio
async def test_a_round_trains_evaluates_optimises_and_hands_over(
    temporal_server: TemporalDevServer,
    scheduler: ServiceProcess,
    policy: Path,
    tmp_path: Path,
    eval_service: ServiceProcess,
    endpoint: str,
) -> None:
    # The main job's sizes (``forge up``'s round) on as many rule pairs as its raters post.
    seeds = period_rule_seed(tmp_path, limit=MAIN_JOB_PAIRS)
    feedback = start_feedback(tmp_path / "feedback", seeds, limit=MAIN_JOB_PAIRS)
    try:
        await rate(feedback, "alice", MAIN_JOB_PAIRS)
        await rate(feedback, "bob", 15)
        await rate(feedback, "mallory", 15, adversarial=True)
        params = loop_input(
            policy,
            tmp_path / "work",
            **{
                **RLHF_SIZES,
                "promote": True,
                # The scripted endpoint answers GSM8K (a model server per checkpoint would double
                # the test's time); forge up's round hands over on the default suite, served.
                "promote_endpoint": endpoint,
                "promote_suite": "gsm8k",
                "promote_limit": 4,
            },
        )
        result, workflow_id, agent = await run_loop(
            temporal_server, scheduler, feedback, eval_service.grpc_target, params, tmp_path / "runs"
        )
        [record] = result.rounds
        [row] = await rounds_of(feedback, workflow_id)
        registered = await reward_model(feedback, record.reward_model)
    finally:
        feedback.process.stop()

    print(f"\nfull round: {json.dumps(dataclasses.asdict(record), default=str)}")
    assert set(agent.ran) == set(Agent.SUFFIXES)
    # Gate passed: significantly above chance, registered active with its snapshot.
    assert record.rm_ci95_low > 0.5, record.reason
    assert registered.status == feedback_pb2.REWARD_MODEL_STATUS_ACTIVE
    assert registered.snapshot_id == record.snapshot_id and registered.heldout.n == record.rm_n
    # Policy round: the DPO checkpoint was scored against the reference under the pinned RM.
    reference, newest = record.drift
    assert reference.kl == 0.0 and newest.policy == record.policy_uri
    assert newest.sqrt_kl >= 0.0 and 0.0 <= newest.heldout_agreement <= 1.0
    check = json.loads(
        (tmp_path / "work" / workflow_id / "round-1" / "policy-check" / "summary.json").read_text()
    )
    assert check["reward_model"] == record.reward_model_uri and check["reference"] == str(policy)
    # DPO ran with the over-optimisation monitor every 2 steps (the main job's sizes): the trace the
    # job wrote is the round's, from the reference point on.
    monitor = record.training_monitor
    assert monitor[0]["step"] == 0.0 and monitor[0]["kl"] == 0.0 and len(monitor) >= 2
    assert [p["step"] for p in monitor] == [2.0 * i for i in range(len(monitor))]
    assert record.early_stop == "" or record.early_stop.startswith("over-optimisation at step")
    # Handed over: eval-and-promote promoted it (no production model to beat), the round completed.
    assert record.decision == "promoted" and record.status == "completed"
    assert result.policy_uri == record.policy_uri
    assert (row.status, row.policy_uri) == ("completed", record.policy_uri)
    assert row.metrics["sqrt_kl"] == pytest.approx(newest.sqrt_kl)
    assert (
        row.reward_model.version
        and f"{row.reward_model.name}:{row.reward_model.version}" == record.reward_model
    )
