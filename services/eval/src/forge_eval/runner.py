"""Running a suite against a model: the ``SuiteRunner`` seam and the OpenAI-compatible runner.

The run service (:class:`~forge_eval.runs.RunService`) calls a runner once per run, after marking
the run RUNNING, and stores what it returns; a runner never touches the database. It raises
:class:`RunnerError` with a message a user can act on when it cannot score the run (endpoint
unreachable, model not served), and the run becomes FAILED with that message: a run never reports
scores it did not get from the model.
"""

from __future__ import annotations

import asyncio
import csv
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx

from forge_eval.spec import RunSpec
from forge_kit.backoff import AIMDLimiter, GaveUp, RetryPolicy, send_with_retries
from forge_kit.modelref import label


class RunnerError(Exception):
    """The run cannot produce results; the message says why."""


@dataclass(frozen=True)
class Example:
    """One benchmark item: its stable id, the prompt body and the reference answer."""

    id: str
    prompt: str
    target: str


@dataclass(frozen=True)
class ExampleResult:
    """One example's score for one metric and what the model said."""

    example_id: str
    metric: str
    score: float
    prompt: str = ""
    output: str = ""
    extracted: str = ""
    target: str = ""


def pinned_model(spec: RunSpec, served_version: str) -> str:
    """What a run asks an endpoint for when it lists the model by name only, declaring
    ``served_version``: the bare name when it declares no version (it knows no other), else
    ``name:version``, whichever version its card shows — the gateway lists one card per name even
    when replicas serve several versions of it (a canary), and routes ``name:version`` to that
    version's replicas only; an endpoint that does not serve the version refuses the requests, so
    a run scores the version its spec pins, or fails."""
    if not spec.model_version or not served_version:
        return spec.model_name
    return label(spec.model_name, spec.model_version)


class SuiteRunner(Protocol):
    """Scores a pinned run spec against a model endpoint.

    Called by :class:`forge_eval.runs.RunService`: ``supports`` and ``scorer_version`` when a
    run is requested (both go into validation and the spec hash), ``run`` by the run worker.
    """

    def supports(self, suite: str) -> bool:
        """Whether this runner can score ``suite``."""

    def scorer_version(self, suite: str) -> str:
        """Version of the prompt format, answer extraction and scoring of ``suite``."""

    async def run(self, spec: RunSpec, endpoint: str, *, token: str | None = None) -> list[ExampleResult]:
        """Score every selected example; raise :class:`RunnerError` when that is impossible.
        ``token`` is the credential bound to the endpoint (empty: send none); None: the runner's
        configured one (the CLI's local runs)."""


# --- suites ------------------------------------------------------------------------------------

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_STRICT = re.compile(r"####\s*(-?\d[\d,]*(?:\.\d+)?)")
_LETTER = re.compile(r"\b([ABCD])\b")


def _number(text: str) -> str:
    return text.replace(",", "").rstrip(".")


def _gsm8k(root: Path) -> list[Example]:
    rows = [
        json.loads(line) for line in (root / "gsm8k" / "test.jsonl").read_text().splitlines() if line.strip()
    ]
    return [
        Example(
            f"test:{i}", f"Question: {r['question']}\nAnswer:", _number(r["answer"].split("####")[-1].strip())
        )
        for i, r in enumerate(rows)
    ]


def _gsm8k_shots(root: Path) -> list[str]:
    rows = [
        json.loads(line) for line in (root / "gsm8k" / "train.jsonl").read_text().splitlines() if line.strip()
    ]
    return [f"Question: {r['question']}\nAnswer: {r['answer']}" for r in rows]


def _gsm8k_score(output: str, target: str) -> list[tuple[str, float, str]]:
    strict = _STRICT.search(output)
    strict_answer = _number(strict.group(1)) if strict else ""
    numbers = _NUMBER.findall(output.split("\n\n")[0])
    flexible = _number(numbers[-1]) if numbers else ""
    return [
        ("exact_match_strict", float(strict_answer == target), strict_answer),
        ("exact_match_flexible", float(flexible == target), flexible),
    ]


def _bbh(root: Path) -> list[Example]:
    examples = []
    for path in sorted((root / "bbh").glob("*.json")):
        rows = json.loads(path.read_text())["examples"]
        examples += [
            Example(f"{path.stem}:{i}", f"Q: {r['input']}\nA:", r["target"].strip())
            for i, r in enumerate(rows)
        ]
    return examples


def _bbh_score(output: str, target: str) -> list[tuple[str, float, str]]:
    answer = output.strip().split("\n")[0].strip().rstrip(".")
    return [("exact_match", float(answer == target), answer)]


def _mmlu(root: Path) -> list[Example]:
    examples = []
    for path in sorted((root / "mmlu" / "test").glob("*.csv")):
        subject = path.stem.removesuffix("_test")
        with path.open(newline="") as handle:
            for i, row in enumerate(csv.reader(handle)):
                question, *choices, answer = row
                body = "\n".join(f"{letter}. {text}" for letter, text in zip("ABCD", choices, strict=True))
                examples.append(Example(f"{subject}:{i}", f"{question}\n{body}\nAnswer:", answer.strip()))
    return examples


def _mmlu_shots(root: Path) -> list[str]:
    shots = []
    for path in sorted((root / "mmlu" / "dev").glob("*.csv")):
        with path.open(newline="") as handle:
            for row in csv.reader(handle):
                question, *choices, answer = row
                body = "\n".join(f"{letter}. {text}" for letter, text in zip("ABCD", choices, strict=True))
                shots.append(f"{question}\n{body}\nAnswer: {answer.strip()}")
    return shots


def _mmlu_score(output: str, target: str) -> list[tuple[str, float, str]]:
    found = _LETTER.search(output)
    answer = found.group(1) if found else ""
    return [("accuracy", float(answer == target), answer)]


@dataclass(frozen=True)
class _Suite:
    version: str
    examples: Callable[[Path], list[Example]]
    shots: Callable[[Path], list[str]] | None
    score: Callable[[str, str], list[tuple[str, float, str]]]


#: Generation-scored suites; log-likelihood MMLU and HumanEval's sandbox belong to the Eval issue.
SUITES: dict[str, _Suite] = {
    "gsm8k": _Suite("gsm8k-gen-1", _gsm8k, _gsm8k_shots, _gsm8k_score),
    "bbh": _Suite("bbh-gen-1", _bbh, None, _bbh_score),
    "mmlu": _Suite("mmlu-gen-letter-1", _mmlu, _mmlu_shots, _mmlu_score),
}


def select_examples(examples: list[Example], limit: int, seed: int) -> list[Example]:
    """All examples, or a seeded sample of ``limit`` of them in their original order."""
    if limit <= 0 or limit >= len(examples):
        return examples
    keep = set(random.Random(seed).sample(range(len(examples)), limit))
    return [e for i, e in enumerate(examples) if i in keep]


class OpenAICompletionsRunner:
    """Scores generation suites through an OpenAI-compatible ``/v1/completions`` endpoint
    (the gateway, a ``model_server`` replica or vLLM), with concurrency that adapts to the server's
    429/503 answers and retries (``forge_kit.backoff``)."""

    def __init__(
        self,
        benchmarks_root: Path,
        *,
        token: str = "",
        timeout_s: float = 60.0,
        concurrency: int = 8,
        attempts: int = 3,
        overload_patience_s: float = 900.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._root = benchmarks_root
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout_s = timeout_s
        self._concurrency = concurrency
        self._attempts = attempts
        self._overload_patience_s = overload_patience_s
        self._transport = transport

    def supports(self, suite: str) -> bool:
        return suite in SUITES

    def scorer_version(self, suite: str) -> str:
        return SUITES[suite].version

    async def run(self, spec: RunSpec, endpoint: str, *, token: str | None = None) -> list[ExampleResult]:
        suite = SUITES[spec.suite]
        examples = select_examples(suite.examples(self._root), spec.limit, spec.seed)
        shots = int(spec.sampling.get("num_fewshot", 0))
        prefix = ""
        if shots and suite.shots is not None:
            pool = suite.shots(self._root)
            prefix = "".join(s + "\n\n" for s in random.Random(spec.seed).sample(pool, min(shots, len(pool))))
        base = endpoint.rstrip("/")
        # The endpoint's own credential (empty: none); None: the runner's configured one.
        bound = {"Authorization": f"Bearer {token}"} if token else {}
        headers = self._headers if token is None else bound
        async with httpx.AsyncClient(
            base_url=base, headers=headers, timeout=self._timeout_s, transport=self._transport
        ) as client:
            model = await self._served_name(client, base, spec)
            limiter = AIMDLimiter(self._concurrency)

            async def one(example: Example) -> list[ExampleResult]:
                prompt = prefix + example.prompt
                output = await self._complete(client, limiter, base, model, prompt, spec)
                return [
                    ExampleResult(example.id, metric, score, prompt, output, extracted, example.target)
                    for metric, score, extracted in suite.score(output, example.target)
                ]

            scored = await asyncio.gather(*(one(e) for e in examples))
        return [result for results in scored for result in results]

    async def _served_name(self, client: httpx.AsyncClient, base: str, spec: RunSpec) -> str:
        try:
            response = await client.get("/v1/models")
            response.raise_for_status()
            cards = {str(m.get("id", "")): m for m in response.json().get("data", [])}
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            raise RunnerError(
                f"model endpoint {base} is unreachable or not OpenAI-compatible: {exc!r}"
            ) from exc
        served = list(cards)
        if label(spec.model_name, spec.model_version) in cards:
            return label(spec.model_name, spec.model_version)
        if spec.model_name in cards:
            return pinned_model(spec, str(cards[spec.model_name].get("version") or ""))
        raise RunnerError(
            f"model endpoint {base} does not serve {label(spec.model_name, spec.model_version)} (it serves {served})"
        )

    async def _complete(
        self,
        client: httpx.AsyncClient,
        limiter: AIMDLimiter,
        base: str,
        model: str,
        prompt: str,
        spec: RunSpec,
    ) -> str:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": spec.sampling["max_tokens"],
            "temperature": spec.sampling["temperature"],
            "top_p": spec.sampling["top_p"],
            "seed": spec.seed,
        }
        try:
            response = await send_with_retries(
                lambda: client.post("/v1/completions", json=body),
                limiter,
                policy=RetryPolicy(attempts=self._attempts, overload_patience_s=self._overload_patience_s),
            )
            response.raise_for_status()
            return str(response.json()["choices"][0]["text"])
        except GaveUp as exc:
            raise RunnerError(f"model endpoint {base} gave up: {exc} (last: {exc.last})") from None
        except (httpx.HTTPStatusError, ValueError, KeyError, IndexError) as exc:
            raise RunnerError(f"model endpoint {base} refused a completion: {exc!r}") from exc
