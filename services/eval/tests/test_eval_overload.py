"""``forge eval run`` with its default settings (64 requests in flight, 16 prompts each) against a
real HTTP model server whose queue holds far fewer: the server answers 429 with ``Retry-After``
beyond ``capacity`` requests in flight, as the model server does when its queue is full. The run
completes with every item scored; a 400 fails it at once."""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from eval_ngram_endpoint import EndpointState, NGramModel, make_app, prompt_texts
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from test_eval_harness import CORPUS_GOOD, QUESTIONS
from typer.testing import CliRunner

from forge_eval.cli import app

pytestmark = pytest.mark.integration


class Queue:
    """The server's admission: ``capacity`` completions at once; ``refuse_all`` answers 400."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_flight = self.peak = self.refused = 0
        self.refuse_all = False
        #: A request with more prompts than this is refused as overloaded even alone (a server
        #: whose waiting queue is smaller than the batch); 0: no such bound.
        self.max_prompts = 0
        self.largest_admitted = 0
        self.bodies: Counter[str] = Counter()
        #: The ``Retry-After`` of a 429, in seconds: every refusal pauses the client's new requests.
        self.retry_after = "1"


def _serve(queue: Queue) -> FastAPI:
    inner = make_app(EndpointState(models={"toy": NGramModel(CORPUS_GOOD)}))

    async def admit(request: Request, call_next: RequestResponseEndpoint) -> Response:
        if request.url.path != "/v1/completions":
            return await call_next(request)
        body = await request.body()
        queue.bodies[hashlib.sha256(body).hexdigest()] += 1
        prompts = len(prompt_texts(json.loads(body).get("prompt")))
        if queue.refuse_all:
            return JSONResponse({"error": {"message": "bad prompt", "param": "prompt"}}, status_code=400)
        if queue.in_flight >= queue.capacity or (queue.max_prompts and prompts > queue.max_prompts):
            queue.refused += 1
            return JSONResponse(
                {"error": {"message": "queue full", "type": "overloaded"}},
                status_code=429,
                headers={"Retry-After": queue.retry_after},
            )
        queue.in_flight += 1
        queue.peak = max(queue.peak, queue.in_flight)
        queue.largest_admitted = max(queue.largest_admitted, prompts)
        try:
            await asyncio.sleep(0.05)  # a forward pass: requests overlap
            return await call_next(request)
        finally:
            queue.in_flight -= 1

    inner.add_middleware(BaseHTTPMiddleware, dispatch=admit)
    return inner


@pytest.fixture
def server() -> Iterator[tuple[str, Queue]]:
    queue = Queue(capacity=2)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(_serve(queue), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 10
    while True:
        try:
            if httpx.get(f"{url}/v1/models").status_code == 200:
                break
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    yield url, queue
    uv.should_exit = True
    thread.join(timeout=5)


def _task(tmp: Path, repeat: int) -> Path:
    data = tmp / "benchmarks" / "toy_mc"
    data.mkdir(parents=True, exist_ok=True)
    with (data / "test.jsonl").open("w") as handle:
        for i, (q, choices, gold) in enumerate(QUESTIONS * repeat):
            handle.write(
                json.dumps({"id": f"q{i}", "text": f"{q} ({i})", "options": choices, "label": gold}) + "\n"
            )
    path = tmp / "toy_mc.yaml"
    path.write_text(
        "name: toy_mc\noutput_type: multiple_choice\ndataset: {path: toy_mc/test.jsonl}\n"
        "template:\n  id: '{{ id }}'\n  prompt: '{{ text }}'\n"
        "  choices: ['{{ options[0] }}', '{{ options[1] }}', '{{ options[2] }}']\n  gold: '{{ label }}'\n"
        "scorer: {name: multiple_choice_loglikelihood}\ngate: {metrics: [acc], tolerance: 0.0}\n"
    )
    return path


def _run(url: str, tmp: Path, repeat: int) -> tuple[int, str, Path]:
    out = tmp / "run"
    args = ["run", "--task", str(_task(tmp, repeat)), "--endpoint", url, "--model", "toy", "--out", str(out)]
    args += ["--benchmarks-dir", str(tmp / "benchmarks"), "--no-cache"]
    result = CliRunner().invoke(app, args)
    return result.exit_code, result.output, out


def test_default_settings_complete_against_a_server_that_says_slow_down(
    server: tuple[str, Queue], tmp_path: Path
) -> None:
    url, queue = server
    repeat = 40  # 3 choices per question: far more 16-prompt batches than the server takes at once
    code, output, out = _run(url, tmp_path, repeat)
    assert code == 0, output
    summary = json.loads((out / "summary.json").read_text())
    samples = [json.loads(line) for line in (out / "samples" / "toy_mc.jsonl").read_text().splitlines()]
    assert len(samples) == repeat * len(QUESTIONS)
    assert all("acc" in s["scores"] for s in samples)
    calls = summary["calls"]
    assert queue.refused > 0 and calls["overloads"] == queue.refused
    assert calls["prompts_sent"] == repeat * len(QUESTIONS) * 3
    assert calls["lowest_concurrency"] < 64 and queue.peak <= queue.capacity


def test_a_batch_larger_than_the_servers_queue_is_halved_until_it_fits(
    server: tuple[str, Queue], tmp_path: Path
) -> None:
    url, queue = server
    queue.max_prompts = 3  # 16-prompt batches are refused even alone: only halving gets through
    # Each halving follows refusals while alone in flight, each paused for Retry-After: a short
    # pause keeps the dozens of them to seconds (the pause itself is the test above's).
    queue.retry_after = "0.1"
    code, output, out = _run(url, tmp_path, 4)
    assert code == 0, output
    calls = json.loads((out / "summary.json").read_text())["calls"]
    assert calls["batches_split"] >= 1
    assert 0 < queue.largest_admitted <= 3
    samples = (out / "samples" / "toy_mc.jsonl").read_text().splitlines()
    assert len(samples) == 4 * len(QUESTIONS)


def test_a_bad_request_fails_the_run_at_once(server: tuple[str, Queue], tmp_path: Path) -> None:
    url, queue = server
    queue.refuse_all = True
    started = time.monotonic()
    code, output, _ = _run(url, tmp_path, 2)
    assert code == 2 and "HTTP 400" in output
    assert time.monotonic() - started < 30
    assert set(queue.bodies.values()) == {1}  # nothing was retried


def test_default_settings_complete_against_the_real_model_server(tmp_path: Path) -> None:
    """The platform's own ``forge_model_server`` (a tiny checkpoint), its batch cut to four
    sequences and its waiting queue to four prompts: a request of the default 16 prompts cannot be
    admitted even alone (at most eight fit), so the server says "slow down" whatever the machine's
    speed, and the run still scores every item."""
    from tiny_checkpoint import make_tiny_checkpoint

    from forge_kit.testing import ServiceProcess, base_env

    make_tiny_checkpoint(tmp_path / "models" / "tiny", context=64)
    data = tmp_path / "benchmarks" / "toy_gen"
    data.mkdir(parents=True)
    words = ["the cat", "one two", "the dog", "a b", "to be", "my lord"]
    rows = [{"q": f"{words[i % len(words)]} {i}", "a": "x"} for i in range(40)]
    (data / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = tmp_path / "toy_gen.yaml"
    task.write_text(
        "name: toy_gen\noutput_type: generate_until\ndataset: {path: toy_gen/test.jsonl}\n"
        "template: {prompt: '{{ q }} ', target: '{{ a }}'}\n"
        "generation: {max_tokens: 4}\nscorer: {name: exact_match}\n"
    )
    server = ServiceProcess(
        "forge_model_server",
        env=base_env(
            "model_server",
            token="overload-token",
            models_dir=str(tmp_path / "models"),
            torch_threads="1",
            max_waiting_requests="4",
            max_num_seqs="4",
        ),
        cwd=str(tmp_path),
        log_path=str(tmp_path / "model_server.log"),
    ).start(90)
    try:
        out = tmp_path / "run"
        args = ["run", "--task", str(task), "--endpoint", server.http_url, "--model", "tiny"]
        args += ["--out", str(out), "--benchmarks-dir", str(tmp_path / "benchmarks"), "--no-cache"]
        result = CliRunner().invoke(app, args, env={"FORGE_CLI_EVAL_ENDPOINT_TOKEN": "overload-token"})
    finally:
        server.stop()
    assert result.exit_code == 0, result.output + (tmp_path / "model_server.log").read_text()[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    samples = (out / "samples" / "toy_gen.jsonl").read_text().splitlines()
    assert len(samples) == len(rows) and summary["calls"]["prompts_sent"] == len(rows)
    assert summary["calls"]["overloads"] > 0  # the server did say "slow down", and the run went on
