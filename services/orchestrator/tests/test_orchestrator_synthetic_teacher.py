"""The synthetic workflow's teacher client against real HTTP servers.

- the programmatic teacher (``forge_training.synthetic.teacher``) served on a real socket: problems
  and k solutions come back in the documented format, the same for a retried call; its refusals
  (an unknown template, a foreign problem id, a wrong token) are 4xx answers the client does not
  retry;
- a misbehaving teacher (a tiny real HTTP server scripted per call): a 429 with ``Retry-After``, a
  malformed answer, an answer that never comes (the per-call timeout), a 500 — each retried and
  counted, the call then succeeding; a teacher that only ever answers malformed JSON costs the
  call (counted in ``failed_calls``), never an exception; a malformed choice among good ones is
  dropped and counted;
- the generate activity over the served teacher writes ``problems.jsonl`` in the training
  library's format and, retried, returns its first result without calling the teacher again.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from temporalio.testing import ActivityEnvironment

from forge_experiments import teacher_protocol as tp
from forge_kit.http import HttpServer
from forge_orchestrator.synthetic.activities import Endpoint, GenerateInput, SyntheticActivities
from forge_orchestrator.synthetic.teacher import TeacherClient
from forge_training.synthetic.problems import ProgrammaticTeacher, loads
from forge_training.synthetic.teacher import build_app

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]
TOKEN = "teacher-test-token"


async def serve(app: FastAPI) -> AsyncIterator[str]:
    server = HttpServer(app, "127.0.0.1", 0)
    await server.start()
    try:
        yield f"http://127.0.0.1:{server.port}/v1"
    finally:
        await server.stop()


@pytest.fixture
async def teacher_url() -> AsyncIterator[str]:
    async for url in serve(build_app(ProgrammaticTeacher(seed=3, error_rate=0.3), token=TOKEN)):
        yield url


def completion(contents: list[str]) -> dict[str, Any]:
    choices = [
        {"index": i, "message": {"role": "assistant", "content": c}, "finish_reason": "stop"}
        for i, c in enumerate(contents)
    ]
    return {"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": choices}


GOOD_PROBLEMS = tp.problems_answer([tp.TeacherProblem("p1", "sums", "What is 2 + 3?", "5")])
GOOD_SOLUTION = tp.solution_answer(tp.TeacherSolution("2 + 3 = <<2+3=5>>5.\n#### 5"))


def scripted(script: list[Callable[[], Any]], calls: list[float]) -> FastAPI:
    """A teacher that answers call i with ``script[i]()`` (the last entry repeats)."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        await request.json()
        calls.append(time.monotonic())
        return await script[min(len(calls), len(script)) - 1]()

    return app


def rate_limited() -> Callable[[], Any]:
    async def answer() -> Any:
        body = {"error": {"message": "slow down", "type": "rate_limit_error", "param": None, "code": None}}
        return JSONResponse(body, status_code=429, headers={"Retry-After": "1"})

    return answer


def returns(body: Any, status: int = 200) -> Callable[[], Any]:
    async def answer() -> Any:
        return JSONResponse(body, status_code=status)

    return answer


def hangs(seconds: float) -> Callable[[], Any]:
    async def answer() -> Any:
        await asyncio.sleep(seconds)
        return JSONResponse(completion([GOOD_PROBLEMS]))

    return answer


async def test_served_teacher_answers_problems_and_k_solutions(teacher_url: str) -> None:
    async with TeacherClient(teacher_url, "forge-teacher", TOKEN, timeout_s=10) as client:
        problems = await client.problems("add_sub", 3, seed=7)
        again = await client.problems("add_sub", 3, seed=7)
        other = await client.problems("add_sub", 3, seed=8)
        solutions = await client.solutions(problems[0], 4, seed=1)
        first_two = await client.solutions(problems[0], 2, seed=1)
    assert len(problems) == 3 and problems == again
    assert {p.id for p in problems}.isdisjoint({p.id for p in other})
    assert all(p.topic == "add_sub" and p.question and p.reference for p in problems)
    assert len(solutions) == 4 and first_two == solutions[:2]
    assert all(s.text.splitlines()[-1].startswith("####") for s in solutions)
    assert client.stats.calls == 5 and client.stats.retries == 0 and client.stats.failed_calls == 0


async def test_served_teacher_refusals_are_not_retried(teacher_url: str) -> None:
    async with TeacherClient(teacher_url, "forge-teacher", TOKEN, timeout_s=10) as client:
        assert await client.problems("no_such_template", 2, seed=0) == []
        foreign = tp.TeacherProblem("add_sub-99-1", "add_sub", "What is 1 + 1?")
        assert await client.solutions(foreign, 2, seed=0) == []
    assert client.stats.refused == 2 and client.stats.failed_calls == 2 and client.stats.retries == 0
    assert (
        "template id" in client.stats.reasons[0]
        and "not a problem this teacher wrote" in client.stats.reasons[1]
    )
    async with TeacherClient(teacher_url, "forge-teacher", "wrong-token", timeout_s=10) as client:
        assert await client.problems("add_sub", 1, seed=0) == []
    assert client.stats.refused == 1 and "HTTP 401" in client.stats.reasons[0]


async def test_rate_limit_malformed_timeout_and_5xx_are_retried_and_counted() -> None:
    calls: list[float] = []
    script = [
        rate_limited(),
        returns(completion(["this is not JSON {"])),
        hangs(6.0),  # twice the client's timeout: the other answers come well within it
        returns({"error": {"message": "boom"}}, status=500),
        returns(completion([GOOD_PROBLEMS])),
    ]
    async for url in serve(scripted(script, calls)):
        async with TeacherClient(url, "m", timeout_s=3.0, max_attempts=5, backoff_s=(0.05, 0.1)) as client:
            problems = await client.problems("sums", 4, seed=0)
    assert [p.question for p in problems] == ["What is 2 + 3?"]
    stats = client.stats
    assert (stats.rate_limited, stats.malformed, stats.timeouts, stats.server_errors) == (1, 1, 1, 1)
    assert stats.calls == 5 and stats.retries == 4 and stats.failed_calls == 0
    assert calls[1] - calls[0] >= 0.9  # the 429's Retry-After (1 s) was waited out
    assert any("rate limited" in r for r in stats.reasons) and any("timed out" in r for r in stats.reasons)


async def test_a_teacher_that_only_answers_garbage_costs_the_call_not_the_run() -> None:
    calls: list[float] = []
    garbage = [
        returns(completion(['{"problems": "nope"}'])),
        returns({"unexpected": True}),
        returns("plain text"),
    ]
    async for url in serve(scripted(garbage, calls)):
        async with TeacherClient(url, "m", timeout_s=10.0, max_attempts=3, backoff_s=(0.01, 0.02)) as client:
            assert await client.problems("sums", 2, seed=0) == []
    assert client.stats.malformed == 3 and client.stats.failed_calls == 1 and len(calls) == 3
    assert "gave up after 3 tries" in client.stats.reasons[-1]


async def test_a_malformed_choice_is_dropped_and_the_good_ones_kept() -> None:
    calls: list[float] = []
    mixed = completion([GOOD_SOLUTION, '{"text": 42}', "```json\n" + GOOD_SOLUTION + "\n```"])
    async for url in serve(scripted([returns(mixed)], calls)):
        async with TeacherClient(url, "m", timeout_s=10.0) as client:
            solutions = await client.solutions(tp.TeacherProblem("p1", "sums", "What is 2 + 3?"), 3, seed=0)
    assert len(solutions) == 2 and solutions[0] == solutions[1]
    assert client.stats.malformed_choices == 1 and client.stats.malformed == 0 and len(calls) == 1


async def test_generate_writes_problems_once(teacher_url: str, tmp_path: Path) -> None:
    acts = SyntheticActivities(Endpoint(teacher_url, TOKEN), Endpoint(""))
    params = GenerateInput(
        work_dir=str(tmp_path / "run"), teacher_url="", teacher_model="forge-teacher",
        templates=["add_sub", "unit_price"], problems=11, k=3, seed=5,
    )  # fmt: skip
    first = await ActivityEnvironment().run(acts.generate, params)
    problems = loads((tmp_path / "run" / "problems.jsonl").read_text())
    assert first.problems == len(problems) == 11 and first.without_solutions == 0
    assert first.teacher["calls"] == 2 + 11  # a problems call per template (6 and 5), a call a problem
    assert sorted({p.template for p in problems}) == ["add_sub", "unit_price"]
    assert all(len(p.solutions) == 3 for p in problems) and len({p.id for p in problems}) == 11
    # A retry finds the summary: the same result, the teacher not called (an unreachable one would fail).
    dead = SyntheticActivities(Endpoint("http://127.0.0.1:9/v1"), Endpoint(""))
    assert await ActivityEnvironment().run(dead.generate, params) == first
    assert json.loads((tmp_path / "run" / "generate.json").read_text())["problems"] == 11
