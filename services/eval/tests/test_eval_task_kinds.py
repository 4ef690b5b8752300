"""New benchmarks of each kind from YAML alone, run against a real (tiny) model: choices that
vary per example (from a list field, through a choice template) with several right answers and
acc / acc_norm / acc_bytes, TruthfulQA's MC2 probability mass, and generation scored by regex
extraction against several references. Scores are checked against the model computed directly."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import test_eval_harness
from eval_ngram_endpoint import EndpointState, NGramModel, make_app
from test_eval_harness import CORPUS_GOOD, BackendFactory

from forge_eval.harness import run_task
from forge_eval.tasks import DataRoots, build_docs, load_task
from forge_kit import errors

# The harness tests' fixtures: the n-gram endpoint, its backend and the data roots.
roots, state, backend_factory = (
    test_eval_harness.roots,
    test_eval_harness.state,
    test_eval_harness.backend_factory,
)

ROWS = [
    {"q": "the cat sat on the", "options": ["mat", "hat", "log", "mat."], "right": [0, 3]},
    {"q": "the dog sat on the", "options": ["hog", "log"], "right": [1]},
    {"q": "one two three", "options": ["four", "five", "one", "two", "six"], "right": [0]},
    {"q": "the cat sat", "options": ["on", "in", "at"], "right": [0, 1]},
]


def write(tmp: Path, name: str, body: str, rows: list[dict[str, object]] = ROWS) -> Path:
    data = tmp / "benchmarks" / name
    data.mkdir(parents=True, exist_ok=True)
    (data / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = tmp / f"{name}.yaml"
    path.write_text(f"name: {name}\ndataset: {{path: {name}/test.jsonl}}\n{body}")
    return path


MC = (
    "output_type: multiple_choice\n"
    "template:\n  prompt: '{{ q }}'\n  choices: '{{ options }}'\n  choice: '{{ choice }}'\n"
    "  delimiter: ' '\n  gold: '{{ right }}'\n"
)


def argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))


async def test_per_example_choices_with_several_right_answers(
    tmp_path: Path, roots: DataRoots, backend_factory: BackendFactory
) -> None:
    task = load_task(
        str(write(tmp_path, "toy_choices", MC + "scorer: {name: multiple_choice_loglikelihood}\n"))
    )
    backend = backend_factory()
    result = await run_task(task, roots, backend, await backend.identity())
    model = NGramModel(CORPUS_GOOD)
    assert [len(s["choices"]) for s in result.samples] == [4, 2, 5, 3]
    for sample, row in zip(result.samples, ROWS, strict=True):
        lls = [model.logprob(row["q"], " " + c) for c in row["options"]]  # type: ignore[union-attr]
        assert [c["logprob"] for c in sample["response"]["choices"]] == pytest.approx(lls, abs=1e-9)
        right = row["right"]
        assert sample["scores"]["acc"] == float(argmax(lls) in right)  # type: ignore[operator]
        chars = [ll / len(c) for ll, c in zip(lls, row["options"], strict=True)]  # type: ignore[arg-type]
        assert sample["scores"]["acc_norm"] == float(argmax(chars) in right)  # type: ignore[operator]
        assert sample["golds" if len(right) > 1 else "gold"] == (right if len(right) > 1 else right[0])  # type: ignore[arg-type,index]


async def test_mc2_is_the_probability_mass_of_the_right_answers(
    tmp_path: Path, roots: DataRoots, backend_factory: BackendFactory
) -> None:
    task = load_task(str(write(tmp_path, "toy_mc2", MC + "scorer: {name: multiple_choice_mc2}\n")))
    backend = backend_factory()
    result = await run_task(task, roots, backend, await backend.identity())
    model = NGramModel(CORPUS_GOOD)
    for sample, row in zip(result.samples, ROWS, strict=True):
        p = [math.exp(model.logprob(row["q"], " " + c)) for c in row["options"]]  # type: ignore[union-attr]
        assert sample["scores"]["mc2"] == pytest.approx(sum(p[i] for i in row["right"]) / sum(p), rel=1e-9)  # type: ignore[union-attr]
    assert result.summary["metric"] == "mc2" and 0 < result.summary["score"] < 1


async def test_generation_scored_by_regex_against_several_references(
    tmp_path: Path, roots: DataRoots, backend_factory: BackendFactory
) -> None:
    model = NGramModel(CORPUS_GOOD)
    rows = [{"q": "the cat sat on the", "refs": ["xyz", "cat"]}, {"q": "one two three", "refs": ["four"]}]
    body = (
        "output_type: generate_until\n"
        "template: {prompt: '{{ q }}', target: '{{ refs[0] }}', targets: '{{ refs }}'}\n"
        "generation: {max_tokens: 6}\n"
        "scorer: {name: regex_match, options: {regex: '([a-z]+)'}}\n"
    )
    task = load_task(str(write(tmp_path, "toy_regex", body, rows)))
    backend = backend_factory()
    result = await run_task(task, roots, backend, await backend.identity())
    for sample, row in zip(result.samples, rows, strict=True):
        generated = ""
        for _ in range(6):
            generated += model.greedy_char(str(row["q"]) + generated)
        first = next(iter(re.findall("[a-z]+", generated)), "")
        assert sample["extracted"]["exact_match"] == first
        assert sample["scores"]["exact_match"] == float(first in row["refs"])  # type: ignore[operator]
    # The trigram model continues "the " with "cat": the second reference matches.
    assert [s["scores"]["exact_match"] for s in result.samples] == [1.0, 0.0]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (
            MC.replace("{{ right }}", "{{ [0, 9] }}") + "scorer: {name: multiple_choice_loglikelihood}\n",
            "task.template.gold",
        ),
        (
            MC.replace("'{{ options }}'", "'{{ [] }}'") + "scorer: {name: multiple_choice_loglikelihood}\n",
            "task.template.choices",
        ),
        (
            "output_type: generate_until\ntemplate: {prompt: '{{ q }}'}\nscorer: {name: regex_match, options: {regex: '(['}}\n",
            "task.scorer.options.regex",
        ),
        (
            "output_type: generate_until\ntemplate: {prompt: '{{ q }}'}\nscorer: {name: regex_match, options: {regex: '(a)', group: 2}}\n",
            "task.scorer.options.group",
        ),
    ],
)
async def test_bad_tasks_are_refused_before_any_model_call(
    tmp_path: Path, roots: DataRoots, backend_factory: BackendFactory, body: str, field: str
) -> None:
    task = load_task(str(write(tmp_path, "toy_bad", body)))
    backend = backend_factory()
    with pytest.raises(errors.ValidationError) as info:
        await run_task(task, roots, backend, await backend.identity())
    assert info.value.field == field
    assert backend.stats.model_calls == 0 and backend.stats.prompts_sent == 0


def test_shipped_tasks_with_per_example_choices_and_several_references_render() -> None:
    from forge_kit.paths import resolve_data_path

    shipped = DataRoots(resolve_data_path("benchmarks"), resolve_data_path("corpora"))
    cloze = build_docs(load_task("mmlu_cloze"), shipped, limit=20, seed=0)
    for doc in cloze:
        row = doc.record
        assert doc.choices == (row["A"], row["B"], row["C"], row["D"]) and doc.prompt.endswith("Answer:")
        assert doc.choices[doc.gold] == row[row["answer"].strip()]
    cot = build_docs(load_task("bbh_cot"), shipped, limit=60, seed=0)
    lettered = [d for d in cot if d.target.startswith("(")]
    assert lettered and all(d.targets == (d.target, d.target.strip("()")) for d in lettered)
    assert all(d.targets[0] == d.target for d in cot)


async def test_an_endpoint_that_cannot_tokenize_fails_the_run_before_scoring(
    tmp_path: Path, roots: DataRoots, state: EndpointState
) -> None:
    """Multiple choice needs the served tokenizer (``/tokenize``, as vLLM serves it): without it
    the run stops with a message naming the route, and no log-likelihood is guessed."""
    import httpx
    from fastapi import Request
    from fastapi.responses import JSONResponse
    from starlette.middleware.base import RequestResponseEndpoint
    from starlette.responses import Response

    from forge_eval.backend import BackendError, OpenAIBackend

    app = make_app(state)

    @app.middleware("http")
    async def no_tokenize(request: Request, call_next: RequestResponseEndpoint) -> Response:
        if request.url.path == "/tokenize":
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return await call_next(request)

    task = load_task(
        str(write(tmp_path, "toy_untokenized", MC + "scorer: {name: multiple_choice_loglikelihood}\n"))
    )
    backend = OpenAIBackend("http://toy", "toy", transport=httpx.ASGITransport(app=app))
    try:
        with pytest.raises(BackendError, match="/tokenize"):
            await run_task(task, roots, backend, await backend.identity())
    finally:
        await backend.aclose()
    assert state.completion_requests == 0
