"""What a synthetic-data teacher is asked and must answer: JSON inside OpenAI chat messages.

The teacher is any OpenAI-compatible ``/v1/chat/completions`` endpoint. In production that is vLLM
serving a strong model; on a machine without one, the training library's programmatic teacher
(``python -m forge_training.synthetic.teacher``) serves the same format from templates, with a
configurable error rate. Both sides of the exchange use this one module: the orchestrator's
teacher client builds requests and parses answers with it, the programmatic teacher parses
requests and builds answers with it.

Two requests, each one chat completion whose **user message is a JSON object**:

- **problems**: ``{"task": "problems", "topic": T, "count": N, "seed": S}``. The answer's content
  (``choices[0].message.content``) is ``{"problems": [{"id": ID, "topic": T, "question": Q}, ...]}``
  with at most N problems; ``id`` is the teacher's own handle for the problem (it comes back in
  the solutions request; a teacher that needs none may send any short string). A teacher that
  knows the answer may add ``"reference": A`` (kept for measuring the verifier, never used by it).
  ``T`` is a seed template's id or a topic in words; the programmatic teacher takes its template
  ids only.
- **solutions**: ``{"task": "solutions", "problem": {"id": ID, "topic": T, "question": Q}, "seed": S}``
  sent with ``n = k``: each of the k choices' content is one solution, ``{"text": W, "program": P}``
  — the worked solution ``W``, one step a line (GSM8K style, calculator annotations
  ``<<expr=value>>`` allowed), its last line ``#### <final answer>`` (a number or a SymPy-readable
  expression), and optionally (``P`` may be ``null`` or absent) a Python program that prints the
  answer (program-of-thought, run in the eval sandbox by the verifier).

The system message (:data:`SYSTEM_PROMPT`) says the same in words, so a real LLM can be prompted
to produce it; a model that wraps its JSON in a Markdown code fence is accepted. Everything
parsed here is hostile input: sizes are bounded, types checked, and a bad answer raises
:class:`MalformedAnswer` naming what is wrong (the client counts it and retries).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

MAX_CONTENT_CHARS = 256 * 1024
"""Longest message content parsed (a larger answer is malformed)."""
MAX_PROBLEMS = 256
"""Most problems one problems request may ask for."""
MAX_SOLUTIONS = 16
"""Most solutions (``n``) one solutions request may ask for (the OpenAI servers' own limit)."""
MAX_TOPIC_CHARS = 128
MAX_ID_CHARS = 128
MAX_QUESTION_CHARS = 4000
MAX_SOLUTION_CHARS = 4000
MAX_REFERENCE_CHARS = 256
MAX_PROGRAM_CHARS = 8000

SYSTEM_PROMPT = """You write grade-school and early-algebra math problems and their worked solutions.
Every request is a JSON object in the user message; answer with ONE JSON object and nothing else.

1. {"task": "problems", "topic": T, "count": N, "seed": S}: write N new problems about topic T.
   Answer {"problems": [{"id": "<short handle>", "topic": T, "question": "<the problem>"}]}.
2. {"task": "solutions", "problem": {"id": ..., "topic": ..., "question": ...}, "seed": S}:
   solve the problem. Answer {"text": "<worked steps, one a line; the last line is
   '#### <final answer: a number or a SymPy expression>'>", "program": "<optional Python program
   that prints the answer, or null>"}.
"""


class MalformedAnswer(ValueError):
    """A teacher's answer that does not follow the format; the message says what is wrong."""


class BadRequest(ValueError):
    """A request the teacher cannot take; the message names the field."""


@dataclass(frozen=True)
class TeacherProblem:
    id: str
    topic: str
    question: str
    reference: str = ""
    """The teacher's own answer when it knows it (the programmatic teacher); empty otherwise."""


@dataclass(frozen=True)
class TeacherSolution:
    text: str
    """Worked steps, the last line ``#### <answer>``."""
    program: str | None = None


def _text(where: str, value: object, limit: int, *, error: type[ValueError], required: bool = True) -> str:
    if not isinstance(value, str):
        raise error(f"{where} must be a string")
    if required and not value.strip():
        raise error(f"{where} must not be empty")
    if len(value) > limit:
        raise error(f"{where} is longer than {limit} characters")
    return value


_FENCE = re.compile(r"^\s*```(?:json)?\s*\n?(.*?)\n?\s*```\s*$", re.DOTALL)


def load_object(
    content: object, where: str = "content", error: type[ValueError] = MalformedAnswer
) -> dict[str, Any]:
    """The JSON object in a message's content (a Markdown code fence around it is accepted)."""
    if not isinstance(content, str):
        raise error(f"{where} must be a string")
    if len(content) > MAX_CONTENT_CHARS:
        raise error(f"{where} is longer than {MAX_CONTENT_CHARS} characters")
    fenced = _FENCE.match(content)
    text = fenced.group(1) if fenced else content
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise error(f"{where} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise error(f"{where} must be a JSON object")
    return data


# --- requests ----------------------------------------------------------------------------------


def problems_request(topic: str, count: int, seed: int) -> str:
    """The user message asking for ``count`` problems about ``topic``."""
    return json.dumps({"task": "problems", "topic": topic, "count": count, "seed": seed})


def solutions_request(problem: TeacherProblem, seed: int) -> str:
    """The user message asking for a solution of ``problem`` (sent with ``n = k``)."""
    body = {"id": problem.id, "topic": problem.topic, "question": problem.question}
    return json.dumps({"task": "solutions", "problem": body, "seed": seed})


def _seed(data: dict[str, Any]) -> int:
    seed = data.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise BadRequest("seed must be an integer in [0, 2^63)")
    return seed


def parse_request(content: object) -> tuple[str, dict[str, Any]]:
    """A teacher's view of a request: ``("problems", {"topic", "count", "seed"})`` or
    ``("solutions", {"problem": TeacherProblem, "seed"})``; :class:`BadRequest` otherwise."""
    data = load_object(content, "messages[-1].content", BadRequest)
    task = data.get("task")
    if task == "problems":
        count = data.get("count")
        if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_PROBLEMS:
            raise BadRequest(f"count must be an integer in [1, {MAX_PROBLEMS}]")
        topic = _text("topic", data.get("topic"), MAX_TOPIC_CHARS, error=BadRequest)
        return "problems", {"topic": topic, "count": count, "seed": _seed(data)}
    if task == "solutions":
        raw = data.get("problem")
        if not isinstance(raw, dict):
            raise BadRequest("problem must be an object")
        return "solutions", {"problem": _problem(raw, "problem", BadRequest), "seed": _seed(data)}
    raise BadRequest("task must be 'problems' or 'solutions'")


# --- answers -----------------------------------------------------------------------------------


def _problem(raw: dict[str, Any], where: str, error: type[ValueError]) -> TeacherProblem:
    reference = raw.get("reference") or ""
    if isinstance(reference, int | float) and not isinstance(reference, bool):
        reference = str(reference)
    return TeacherProblem(
        id=_text(f"{where}.id", raw.get("id"), MAX_ID_CHARS, error=error),
        topic=_text(f"{where}.topic", raw.get("topic"), MAX_TOPIC_CHARS, error=error),
        question=_text(f"{where}.question", raw.get("question"), MAX_QUESTION_CHARS, error=error),
        reference=_text(f"{where}.reference", reference, MAX_REFERENCE_CHARS, error=error, required=False),
    )


def problems_answer(problems: list[TeacherProblem]) -> str:
    rows = [
        {"id": p.id, "topic": p.topic, "question": p.question, "reference": p.reference} for p in problems
    ]
    return json.dumps({"problems": rows})


def solution_answer(solution: TeacherSolution) -> str:
    return json.dumps({"text": solution.text, "program": solution.program})


def parse_problems(content: object, count: int) -> list[TeacherProblem]:
    """The problems of a problems answer (at most ``count``; duplicates by id dropped)."""
    data = load_object(content)
    raw = data.get("problems")
    if not isinstance(raw, list):
        raise MalformedAnswer("problems must be a list")
    if len(raw) > count:
        raise MalformedAnswer(f"{len(raw)} problems for a request of {count}")
    out: dict[str, TeacherProblem] = {}
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise MalformedAnswer(f"problems[{i}] must be an object")
        problem = _problem(item, f"problems[{i}]", MalformedAnswer)
        out.setdefault(problem.id, problem)
    return list(out.values())


def parse_solution(content: object) -> TeacherSolution:
    """One choice's solution."""
    data = load_object(content)
    program = data.get("program")
    if program is not None:
        program = _text("program", program, MAX_PROGRAM_CHARS, error=MalformedAnswer, required=False) or None
    text = _text("text", data.get("text"), MAX_SOLUTION_CHARS, error=MalformedAnswer)
    return TeacherSolution(text=text, program=program)
