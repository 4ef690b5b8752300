"""The programmatic teacher behind an OpenAI-compatible ``/v1/chat/completions`` endpoint.

This is a stand-in. In production the synthetic-data workflow's teacher is vLLM serving a strong
model, prompted with :data:`forge_experiments.teacher_protocol.SYSTEM_PROMPT`; on a machine with no such
model this server answers the same requests (:mod:`forge_experiments.teacher_protocol`: JSON in the
messages) from the seed templates of :mod:`forge_training.synthetic.problems`, with the
programmatic teacher's configurable error rate, so that verification has something to catch.

- a problems request's ``topic`` must be a template id (400 listing the known ones otherwise);
  problem ``i`` of a request with seed ``S`` is the template's problem number
  ``S * MAX_PROBLEMS + i``, and its id (``<template>-<teacher seed>-<number>``) is what a
  solutions request sends back;
- a solutions request with ``n = k`` answers the problem's first ``k`` worked solutions, one a
  choice (the same for any ``k``: a retried call gets the same answers).

Run it with ``python -m forge_training.synthetic.teacher --port 8071 [--error-rate 0.2]
[--seed 0] [--model forge-teacher] [--token-file FILE]``; with a token, requests must carry it as
a bearer token. ``/healthz``, ``/readyz`` and ``/metrics`` are there as on every Forge server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from forge_experiments import teacher_protocol as tp
from forge_kit import errors
from forge_kit.http import HttpServer, make_app
from forge_kit.openai_errors import install_openai_error_handlers, openai_error
from forge_kit.openai_protocol import ChatCompletionBody, message_text, parse
from forge_training.synthetic.problems import TEMPLATES, ProgrammaticTeacher

DEFAULT_MODEL = "forge-teacher"


def _bad(message: str) -> errors.ValidationError:
    return errors.ValidationError("messages", message)


def answer(teacher: ProgrammaticTeacher, content: str, n: int) -> list[str]:
    """The choices' contents for one request's last user message (``n`` choices for solutions)."""
    try:
        task, args = tp.parse_request(content)
    except tp.BadRequest as exc:
        raise _bad(str(exc)) from None
    if task == "problems":
        template = TEMPLATES.get(args["topic"])
        if template is None:
            raise _bad(f"topic must be a template id of this teacher ({', '.join(sorted(TEMPLATES))})")
        first = args["seed"] * tp.MAX_PROBLEMS
        written = [teacher.write(template, first + i, 1) for i in range(args["count"])]
        problems = [tp.TeacherProblem(p.id, p.template, p.question, p.reference) for p in written]
        return [tp.problems_answer(problems)]
    problem: tp.TeacherProblem = args["problem"]
    name, seed, number = _split_id(problem.id)
    if name not in TEMPLATES or seed != teacher.seed or number is None:
        raise _bad(f"problem.id {problem.id[:80]!r} is not a problem this teacher wrote")
    solved = teacher.write(TEMPLATES[name], number, n)
    return [tp.solution_answer(tp.TeacherSolution(s.text, s.program or None)) for s in solved.solutions]


def _split_id(problem_id: str) -> tuple[str, int | None, int | None]:
    name, _, rest = problem_id.rpartition("-")
    name, _, seed = name.rpartition("-")
    try:
        return name, int(seed), int(rest)
    except ValueError:
        return name, None, None


def build_app(teacher: ProgrammaticTeacher, *, model: str = DEFAULT_MODEL, token: str = "") -> FastAPI:
    """The teacher's HTTP app (OpenAI error shapes; bearer ``token`` when given)."""
    app = make_app("synthetic-teacher")
    install_openai_error_handlers(app)

    def authorized(request: Request) -> bool:
        if not token:
            return True
        sent = request.headers.get("authorization", "")
        return hmac.compare_digest(sent.encode(), f"Bearer {token}".encode())

    def refused() -> JSONResponse:
        return openai_error(401, "missing or wrong bearer token", type_="authentication_error")

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        if not authorized(request):
            return refused()
        return {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "forge"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        if not authorized(request):
            return refused()
        try:
            raw = await request.json()
        except ValueError:
            raise errors.ValidationError("body", "is not JSON") from None
        body = parse(ChatCompletionBody, raw)
        if body.model != model:
            return openai_error(
                404, f"model {body.model!r} is not served here (only {model!r})", code="model_not_found"
            )
        if body.stream:
            raise errors.UnsupportedParameterError("stream", "is not supported by the teacher")
        users = [i for i, m in enumerate(body.messages) if m.role == "user"]
        if not users:
            raise _bad("need a user message holding the request")
        contents = answer(teacher, message_text(body.messages[users[-1]], users[-1]), body.n)
        choices = [
            {"index": i, "message": {"role": "assistant", "content": c}, "finish_reason": "stop"}
            for i, c in enumerate(contents[: body.n])
        ]
        chars = sum(len(c) for c in contents)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "usage": {"prompt_tokens": 0, "completion_tokens": chars // 4, "total_tokens": chars // 4},
        }

    return app


async def _serve(args: argparse.Namespace) -> None:
    token = Path(args.token_file).read_text().strip() if args.token_file else ""
    teacher = ProgrammaticTeacher(seed=args.seed, error_rate=args.error_rate)
    server = HttpServer(build_app(teacher, model=args.model, token=token), args.host, args.port)
    await server.start()
    print(f"synthetic teacher {args.model} on http://{args.host}:{server.port}/v1", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await server.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="The programmatic teacher as an OpenAI-compatible endpoint.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8071)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="The model name it answers to.")
    parser.add_argument("--seed", type=int, default=0, help="The teacher's seed (problem ids carry it).")
    parser.add_argument(
        "--error-rate", type=float, default=0.2, help="Share of solutions with a planted error."
    )
    parser.add_argument("--token-file", default="", help="File holding the bearer token requests must carry.")
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args))


if __name__ == "__main__":
    main()
