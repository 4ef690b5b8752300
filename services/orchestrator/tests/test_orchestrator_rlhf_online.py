"""An online RLHF round on real processes: the Temporal dev server, a model server serving a tiny
Llama, the inference gateway in front of it, the preference-feedback service and the scheduler.

The round samples the policy (``tiny`` as the gateway serves it) on its prompt pool — HH-RLHF
prompts plus the production prompts of tenants that allowed training — and queues the pairs for
raters as ``policy`` comparisons.

- ``test_a_round_nobody_rates_ends_stalled_with_the_reason``: no rater answers; the round ends
  ``stalled`` at its deadline (not hung), with the counts, in the result and in the feedback
  service's round record. Its queue holds the policy's samples of the pool's prompts: the
  opted-in tenant's prompt is among them, the other tenant's never.
- ``test_canary_shadow_pairs_are_queued_once_with_origin_shadow``: the gateway mirrors an
  alias's requests to its shadow; the shadow-pairs activity queues the stored pairs as ``shadow``
  comparisons, nothing while the alias has no shadow, each pair once (cursor and keys).
- ``test_answers_to_the_policy_samples_let_the_round_train``: raters answer the round's
  comparisons (the main job's rule-based rater pool) while it waits; once enough are accepted it snapshots and starts training the
  reward model (the test stops it there: the training path is ``test_orchestrator_rlhf.py``'s).
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from forge.feedback.v1 import feedback_pb2, feedback_pb2_grpc
from temporalio.client import Client
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError
from temporalio.worker import Replayer

from forge_kit.grpckit import make_channel
from forge_kit.paths import data_dir
from forge_kit.testing import ServiceProcess, TemporalDevServer, base_env
from forge_kit.testing.tiny_llama import save_tiny_llama
from forge_orchestrator.activities import SchedulerActivities
from forge_orchestrator.eval_activities import EvalActivities
from forge_orchestrator.inbox import PROGRESS_QUERY
from forge_orchestrator.main_job.raters import RaterPool
from forge_orchestrator.rlhf.activities import RlhfActivities
from forge_orchestrator.rlhf.sampling import RlhfSampler
from forge_orchestrator.rlhf.shadow import ShadowInput, ShadowPairs
from forge_orchestrator.rlhf.worker import build_rlhf_worker, rlhf_task_queue
from forge_orchestrator.rlhf.workflow import RLHF_WORKFLOWS, RlhfInput, RlhfResult

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(600)]
SCHEDULER_TOKEN = "scheduler-test-token"  # the session scheduler's token (conftest)
FEEDBACK_TOKEN = "feedback-test-token"
GATEWAY_TOKEN = "gateway-test-token"
UPSTREAM_TOKEN = "upstream-test-token"
DEFAULT_KEY = "default-tenant-key"
HH = data_dir() / "preferences" / "hh-rlhf"
OPTED_IN = "Explain how tides work, briefly."
NOT_OPTED_IN = "Our confidential launch plan is"


@pytest.fixture(scope="module")
def model_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    root = tmp_path_factory.mktemp("model-server")
    save_tiny_llama(root / "models" / "tiny", initializer_range=0.2)
    env = base_env("model_server", token=UPSTREAM_TOKEN, models_dir=str(root / "models"), torch_threads="1")
    proc = ServiceProcess("forge_model_server", env=env, cwd=str(root), log_path=str(root / "log")).start(60)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def gateway(
    model_server: ServiceProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcess]:
    root = tmp_path_factory.mktemp("gateway")
    env = base_env(
        "inference_gateway",
        token=GATEWAY_TOKEN,
        data_dir=root / "data",
        model_server_url=model_server.http_url,
        model_server_token=UPSTREAM_TOKEN,
        bootstrap_api_key=DEFAULT_KEY,
        response_cache_ttl_s="0",
    )
    proc = ServiceProcess(
        "forge_inference_gateway", env=env, cwd=str(root), log_path=str(root / "log")
    ).start(60)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def production_traffic(gateway: ServiceProcess) -> list[str]:
    """Two tenants chat through the gateway: ``lab`` allowed training on its prompts, ``shop`` did not."""
    admin = {"Authorization": f"Bearer {GATEWAY_TOKEN}"}
    sent = []
    with httpx.Client(base_url=gateway.http_url, headers=admin, timeout=30) as http:
        for name, allowed, text in (("lab", True, OPTED_IN), ("shop", False, NOT_OPTED_IN)):
            made = http.post("/admin/v1/tenants", json={"name": name, "allow_training": allowed})
            assert made.status_code == 201, made.text
            with openai.OpenAI(
                base_url=f"{gateway.http_url}/v1", api_key=made.json()["api_key"], max_retries=2, timeout=60
            ) as sdk:
                reply = sdk.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": text}], max_tokens=4
                )
            assert reply.choices[0].message.content is not None
            sent.append(text)
        pool = http.get("/admin/v1/training-prompts").json()["prompts"]
    assert [p["prompt"] for p in pool] == [OPTED_IN]
    return sent


@pytest.fixture
def feedback(tmp_path: Path) -> Iterator[tuple[ServiceProcess, Path]]:
    data = tmp_path / "feedback"
    process = ServiceProcess(
        "forge_preference_feedback",
        env=base_env(
            "preference_feedback", token=FEEDBACK_TOKEN, data_dir=data, quality_min_median_seconds="0"
        ),
        log_path=str(tmp_path / "feedback.log"),
    )
    process.start()
    yield process, data
    process.stop()


def queued(data: Path) -> list[tuple[str, str, str, str, str]]:
    """The feedback service's comparisons: origin, batch, prompt and the two responses' authors."""
    with sqlite3.connect(data / "preference_feedback.db") as conn:
        return list(
            conn.execute(
                "SELECT origin, batch, prompt, response_a_model, response_b_model FROM feedback_comparisons ORDER BY seq"
            )
        )


def online_input(tmp_path: Path, **change: Any) -> RlhfInput:
    base: dict[str, Any] = {
        "policy_uri": str(tmp_path / "policy"),
        "work_uri": str(tmp_path / "work"),
        "sample_model": "tiny",
        "prompt_dataset": str(HH / "helpful-base" / "test.jsonl.gz"),
        "dataset_prompts": 3,  # HH-RLHF transcripts; some exceed the tiny model's 256 tokens
        "production_prompts": 10,
        "sample_max_tokens": 8,
        "min_policy_pairs": 3,
        "min_raters": 2,
        "poll_s": 0.5,
        "max_poll_s": 1.0,
        "buffer_timeout_s": 8.0,
        "heldout_fraction": 0.4,
        "python": sys.executable,
        "promote": False,
    }
    return RlhfInput(**{**base, **change})


@pytest.fixture
async def worker(
    temporal_server: TemporalDevServer,
    scheduler: ServiceProcess,
    gateway: ServiceProcess,
    feedback: tuple[ServiceProcess, Path],
) -> AsyncIterator[tuple[Client, str]]:
    client = await Client.connect(temporal_server.target)
    queue = f"rlhf-online-{uuid.uuid4().hex[:8]}"
    acts = SchedulerActivities(scheduler.grpc_target, SCHEDULER_TOKEN)
    evals = EvalActivities("127.0.0.1:1", "unused")
    rlhf = RlhfActivities(feedback[0].grpc_target, FEEDBACK_TOKEN)
    sampler = RlhfSampler(
        gateway.grpc_target, gateway.http_url, GATEWAY_TOKEN, feedback[0].grpc_target, FEEDBACK_TOKEN
    )
    try:
        async with build_rlhf_worker(client, queue, acts, evals, rlhf, sampler, guard=None):
            yield client, queue
    finally:
        for closer in (acts.close, evals.close, rlhf.close):
            await closer()


async def test_a_round_nobody_rates_ends_stalled_with_the_reason(
    worker: tuple[Client, str],
    feedback: tuple[ServiceProcess, Path],
    production_traffic: list[str],
    tmp_path: Path,
) -> None:
    client, queue = worker
    workflow_id = f"{queue}-stall"
    handle = await client.start_workflow(
        "rlhf",
        online_input(tmp_path),
        id=workflow_id,
        task_queue=rlhf_task_queue(queue),
        result_type=RlhfResult,
    )
    result: RlhfResult = await asyncio.wait_for(handle.result(), timeout=240)
    (record,) = result.rounds
    assert record.status == "stalled"
    assert record.reason.startswith("raters did not answer in time: 0 accepted preference(s) of 3 needed")
    assert "from 0 rater(s), 2 needed" in record.reason and result.ended == record.reason
    assert record.prompts == {"dataset": 3, "production": 1}
    assert record.queued >= 2  # prompts longer than the tiny model's context are skipped
    assert record.reward_model == "" and record.snapshot_id == ""  # nothing was trained
    # The queue holds the policy's own samples of the pool's prompts, under the round's batch.
    rows = [r for r in queued(feedback[1]) if r[0] == "policy"]
    assert len(rows) == record.queued
    assert {r[1] for r in rows} == {record.batch} and record.batch == f"{workflow_id}/r1"
    prompts = {r[2] for r in rows}
    assert OPTED_IN in prompts and NOT_OPTED_IN not in prompts  # the shop never allowed training
    assert all(r[3].startswith("tiny") and r[4].startswith("tiny") for r in rows)
    assert {r[3].rpartition("@")[2] for r in rows} | {r[4].rpartition("@")[2] for r in rows} == {
        "t=0.7",
        "t=1.3",
    }
    # The feedback service's round record says the same.
    async with make_channel(feedback[0].grpc_target, token=FEEDBACK_TOKEN) as channel:
        stub = feedback_pb2_grpc.PreferenceFeedbackServiceStub(channel)
        (row,) = (
            await stub.ListRlhfRounds(feedback_pb2.ListRlhfRoundsRequest(workflow_id=workflow_id))
        ).rounds
    assert row.status == "stalled" and row.reason == record.reason
    assert row.metrics["queued"] == record.queued
    await Replayer(workflows=list(RLHF_WORKFLOWS)).replay_workflow(await handle.fetch_history())


async def test_answers_to_the_policy_samples_let_the_round_train(
    worker: tuple[Client, str],
    feedback: tuple[ServiceProcess, Path],
    production_traffic: list[str],
    tmp_path: Path,
) -> None:
    client, queue = worker
    handle = await client.start_workflow(
        "rlhf",
        online_input(tmp_path, buffer_timeout_s=120.0),
        id=f"{queue}-answered",
        task_queue=rlhf_task_queue(queue),
        result_type=RlhfResult,
    )
    try:
        while "waiting for raters" not in str((await handle.query(PROGRESS_QUERY))["step"]):
            await asyncio.sleep(0.2)
        # The main job's rule-based rater pool answers what the feedback service hands out.
        pool = RaterPool(feedback[0].grpc_target, FEEDBACK_TOKEN, raters=3, dwell_s=0.0)
        stop = asyncio.Event()
        raters = asyncio.create_task(pool.run(stop))
        # Once the answers are in, the round leaves the wait, exports a snapshot and goes on to
        # the reward-model job. With no agent here it moves on (and may end) soon after, so the
        # test reads the first progress past the wait with its snapshot rather than one step.
        progress: dict[str, Any] = {}
        try:
            for _ in range(600):
                progress = await handle.query(PROGRESS_QUERY)
                rounds = progress["rounds"]
                if "waiting for raters" not in str(progress["step"]) and rounds and rounds[0]["snapshot_id"]:
                    break
                await asyncio.sleep(0.1)
        finally:
            stop.set()
            answered = await raters
        assert answered >= 3 and len(pool.answered) == 3 and not pool.errors
        (record,) = progress["rounds"]
        assert record["status"] != "stalled", progress
        assert record["new_pairs"] >= 3 and record["snapshot_id"], progress
    finally:
        with contextlib.suppress(RPCError):  # already ended by itself
            await handle.terminate("test: the training path is test_orchestrator_rlhf.py's")


async def test_canary_shadow_pairs_are_queued_once_with_origin_shadow(
    gateway: ServiceProcess, feedback: tuple[ServiceProcess, Path]
) -> None:
    admin = {"Authorization": f"Bearer {GATEWAY_TOKEN}"}
    shadows = ShadowPairs(gateway.http_url, GATEWAY_TOKEN, feedback[0].grpc_target, FEEDBACK_TOKEN)
    alias, batch = "tiny-shadowed", "shadow-test/r1"
    async with httpx.AsyncClient(base_url=gateway.http_url, headers=admin, timeout=30) as http:
        made = await http.put(f"/admin/v1/aliases/{alias}", json={"model": {"name": "tiny"}})
        assert made.status_code == 200, made.text
        # No shadow on the alias: nothing to queue.
        none = await shadows.queue_shadow_pairs(ShadowInput(batch, alias))
        assert (none.shadowed, none.queued, none.next_after_id) == (False, 0, 0)
        shadow = await http.put(
            f"/admin/v1/aliases/{alias}/shadow", json={"model": {"name": "tiny"}, "percent": 100}
        )
        assert shadow.status_code == 200, shadow.text
        async with openai.AsyncOpenAI(
            base_url=f"{gateway.http_url}/v1", api_key=DEFAULT_KEY, max_retries=2, timeout=60
        ) as sdk:
            for n in range(6):
                reply = await sdk.chat.completions.create(
                    model=alias,
                    messages=[{"role": "user", "content": f"Tell me about the sea, number {n}."}],
                    max_tokens=8,
                    temperature=1.0,
                    user=f"shadow-user-{n}",
                )
                assert reply.choices[0].message.content is not None
        for _ in range(120):  # the mirror runs after each answer went back
            stored = (await http.get("/admin/v1/shadow/pairs", params={"alias": alias})).json()["pairs"]
            if len(stored) == 6:
                break
            await asyncio.sleep(0.5)
        assert len(stored) == 6

    first = await shadows.queue_shadow_pairs(ShadowInput(batch, alias, limit=100))
    assert first.shadowed and first.next_after_id == stored[-1]["id"]
    assert first.queued >= 1 and first.queued + sum(first.skipped.values()) == 6, first
    rows = [r for r in queued(feedback[1]) if r[0] == "shadow"]
    assert len(rows) == first.queued and {r[1] for r in rows} == {batch}
    assert all(
        r[2].startswith("\n\nHuman: Tell me about the sea") and r[2].endswith("\n\nAssistant:") for r in rows
    )
    assert all(sum(m.endswith("@shadow") for m in (r[3], r[4])) == 1 for r in rows)  # one answer each
    # From the cursor: nothing new; from the start again: the same keys, nothing queued twice.
    again = await shadows.queue_shadow_pairs(ShadowInput(batch, alias, after_id=first.next_after_id))
    assert again.queued == 0 and again.next_after_id == first.next_after_id
    replay = await shadows.queue_shadow_pairs(ShadowInput(batch, alias))
    assert replay.queued == first.queued
    assert len([r for r in queued(feedback[1]) if r[0] == "shadow"]) == first.queued
    # Hostile input is refused before anything is read.
    for bad in (
        ShadowInput(batch, "../admin"),
        ShadowInput(batch, alias, limit=0),
        ShadowInput(batch, alias, -1),
    ):
        with pytest.raises(ApplicationError):
            await shadows.queue_shadow_pairs(bad)
