"""kill -9 of the eval service in the middle of a run.

A real model_server serves a random Llama; the eval service scores tinyshakespeare perplexity
against it, and is killed with SIGKILL while the run is scoring, then started again in place. A
second eval service, with a database and response cache of its own, runs the same spec without
interruption as the reference.

Afterwards: the run finished once (SUCCEEDED, every example scored, the same result as the
reference — defined below), and the resumed run asked the model again only for what had not come
back before the kill (the response cache keeps each answer as its batch returns), so the model
calls of both halves together stay within the reference's count plus what was in flight.

"The same result" (:func:`assert_same_result`): the same examples scored, each with the same token
count (exactly), each example's score and each aggregate metric (value, interval, n) equal to a
relative 1e-6. Not to the last bit: the model server batches concurrent requests, and a forward
pass over a different batch adds in a different order, so a resumed run — whose requests meet
other neighbours than the uninterrupted run's — sees its log-likelihoods move in the last bits
(seen: ``bits_per_byte`` 7.257176540491426 against 7.257176540392995, 1.4e-11 relative). 1e-6 is
five orders of magnitude above that and far below any change of model, data or scoring.
"""

from __future__ import annotations

import asyncio
import math
import sqlite3
import time
from pathlib import Path

import pytest
from fault_platform import model_server_process, vllm_metric, wait_ready
from forge.common.v1 import common_pb2
from forge.eval.v1 import eval_pb2, eval_pb2_grpc

from forge_kit.grpckit import make_channel
from forge_kit.paths import data_dir
from forge_kit.testing import ServiceProcess, base_env, free_port, tiny_llama

pytestmark = [pytest.mark.integration, pytest.mark.faults_full, pytest.mark.timeout(300)]
TOKEN = "faults-eval-token"
DATA = data_dir()
DOCUMENTS = 24
CONCURRENCY = 4
SAME_RESULT_REL_TOL = 1e-6  # see the module docstring: batch composition moves the last bits


def example_rows(data: Path, run_id: str) -> dict[tuple[str, str], tuple[float, str]]:
    """(metric, example id) → (score, extracted) of one run, from the service's database."""
    (database,) = data.glob("*.db")
    with sqlite3.connect(database) as conn:
        rows = conn.execute(
            "SELECT metric, example_id, score, extracted FROM eval_run_examples WHERE run_id = ?", (run_id,)
        ).fetchall()
    return {(str(m), str(e)): (float(s), str(x)) for m, e, s, x in rows}


def assert_same_result(
    resumed: eval_pb2.EvalRun, reference: eval_pb2.EvalRun, resumed_dir: Path, reference_dir: Path
) -> tuple[int, float]:
    """The resumed run's result is the reference's (the module docstring's definition); returns
    how many per-example scores were compared and the largest relative difference among them."""

    def close(a: float, b: float) -> bool:
        return math.isclose(a, b, rel_tol=SAME_RESULT_REL_TOL, abs_tol=1e-12)

    ours, theirs = example_rows(resumed_dir, resumed.run_id), example_rows(reference_dir, reference.run_id)
    assert ours.keys() == theirs.keys(), "different examples scored"
    widest = 0.0
    for key, (score, extracted) in ours.items():
        their_score, their_extracted = theirs[key]
        widest = max(widest, abs(score - their_score) / max(abs(their_score), 1e-300))
        assert close(score, their_score), (key, score, their_score)
        if key[0] == "nll_per_token":  # its extracted value is the example's token count
            assert extracted == their_extracted, (key, extracted, their_extracted)
    metrics = {m.name: m for m in resumed.metrics}
    assert metrics and metrics.keys() == {m.name for m in reference.metrics}
    for m in reference.metrics:
        got = metrics[m.name]
        assert got.n == m.n, (m.name, got.n, m.n)
        for a, b in ((got.value, m.value), (got.ci_low, m.ci_low), (got.ci_high, m.ci_high)):
            assert close(a, b), (m.name, a, b)
    return len(ours), widest


def eval_process(root: Path, name: str, endpoint: str, endpoint_token: str) -> ServiceProcess:
    return ServiceProcess(
        "forge_eval",
        env=base_env(
            "eval",
            token=TOKEN,
            data_dir=root / name,
            grpc_port=free_port(),
            http_port=free_port(),
            response_cache_path=str(root / name / "cache.sqlite"),
            # The model server is eval's model endpoint here: its token is sent only there.
            inference_gateway_url=endpoint,
            inference_gateway_token=endpoint_token,
            corpora_dir=str(DATA / "corpora"),
            benchmarks_dir=str(DATA / "benchmarks"),
            request_concurrency=str(CONCURRENCY),
            request_batch_size="1",  # one prompt per call: the kill lands between answers
        ),
        log_path=str(root / f"{name}.log"),
    )


def served(model_server: ServiceProcess) -> float:
    """Requests the model server finished (its vLLM counter)."""
    return vllm_metric(model_server, "vllm:request_success_total")


async def submit(evals: ServiceProcess, checkpoint: Path, endpoint: str) -> str:
    async with make_channel(evals.grpc_target, token=TOKEN) as channel:
        stub = eval_pb2_grpc.EvalServiceStub(channel)
        registered = await stub.RegisterModel(
            eval_pb2.RegisterModelRequest(ref=common_pb2.ModelRef(name="llama"), uri=str(checkpoint)),
            timeout=30,
        )
        started = await stub.RunSuite(
            eval_pb2.RunSuiteRequest(
                suite="tinyshakespeare_ppl",
                model=registered.model.ref,
                endpoint=endpoint,
                limit=DOCUMENTS,
                seed=7,
            ),
            timeout=30,
        )
    return started.run_id


async def run_state(evals: ServiceProcess, run_id: str) -> eval_pb2.EvalRun:
    async with make_channel(evals.grpc_target, token=TOKEN) as channel:
        reply = await eval_pb2_grpc.EvalServiceStub(channel).GetRun(
            eval_pb2.GetRunRequest(run_id=run_id), timeout=30
        )
    return reply.run


async def finished(evals: ServiceProcess, run_id: str, timeout_s: float = 180) -> eval_pb2.EvalRun:
    deadline = time.monotonic() + timeout_s
    while True:
        run = await run_state(evals, run_id)
        if run.status not in (eval_pb2.RUN_STATUS_PENDING, eval_pb2.RUN_STATUS_RUNNING):
            return run
        assert time.monotonic() < deadline, f"run {run_id} still {run.status} after {timeout_s}s"
        await asyncio.sleep(0.2)


async def test_eval_kill_mid_run_resumes_to_the_same_result(tmp_path: Path) -> None:
    checkpoint = tiny_llama.save_tiny_llama(tmp_path / "models" / "llama", hidden=256, layers=4)
    model_server = model_server_process(tmp_path, "model_server", TOKEN).start(90)
    evals = eval_process(tmp_path, "eval", model_server.http_url, TOKEN).start(60)
    reference = eval_process(tmp_path, "reference", model_server.http_url, TOKEN)
    try:
        # 1. The interrupted run: kill -9 once some of its requests are answered, start again.
        start = served(model_server)
        run_id = await submit(evals, checkpoint, model_server.http_url)
        while served(model_server) - start < 8:
            assert (await run_state(evals, run_id)).status in (
                eval_pb2.RUN_STATUS_PENDING,
                eval_pb2.RUN_STATUS_RUNNING,
            ), "the run ended before the kill: make it longer"
            await asyncio.sleep(0.02)
        evals.kill()
        before_kill = served(model_server) - start
        await asyncio.to_thread(evals.start, 60)
        await asyncio.to_thread(wait_ready, evals)
        resumed = await finished(evals, run_id)
        interrupted_calls = served(model_server) - start
        # 2. The reference: the same spec, uninterrupted, with its own database and cache.
        reference.start(60)
        mark = served(model_server)
        reference_run = await finished(reference, await submit(reference, checkpoint, model_server.http_url))
        reference_calls = served(model_server) - mark
    finally:
        reference.stop()
        evals.stop()
        model_server.stop()
    print(
        f"\nfault eval kill -9: {before_kill:.0f} model calls answered before the kill, "
        f"{interrupted_calls:.0f} in all for the interrupted run, {reference_calls:.0f} for the reference"
    )
    assert resumed.status == eval_pb2.RUN_STATUS_SUCCEEDED, resumed.error
    assert resumed.spec_hash == reference_run.spec_hash
    assert resumed.example_count == reference_run.example_count == DOCUMENTS
    compared, widest = assert_same_result(resumed, reference_run, tmp_path / "eval", tmp_path / "reference")
    print(
        f"fault eval kill -9: {compared} example scores equal to the reference's, widest gap {widest:.1e} relative"
    )
    assert compared >= 2 * DOCUMENTS  # bits per byte and nats per token of each document at least
    # Answers that came back before the kill were not asked for again (at most what was in flight).
    assert interrupted_calls <= reference_calls + CONCURRENCY
