"""The harness against a real (tiny) model behind an OpenAI-compatible app: log-likelihood
multiple choice, perplexity and generation scored from real logprobs; the response cache, batch
independence, retries, re-scoring, and the paired comparison with the release gate."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from eval_ngram_endpoint import EndpointState, NGramModel, make_app

from forge_eval.backend import OpenAIBackend, ResponseCache
from forge_eval.harness import compare_runs, read_samples, rescore_task, run_task, windows, write_run
from forge_eval.spec import BenchmarkCatalog
from forge_eval.tasks import DataRoots, load_task
from forge_kit import errors
from forge_kit.db import Database
from forge_kit.paths import resolve_data_path

CORPUS_GOOD = "the cat sat on the mat. the dog sat on the log. " * 20 + "one two three four five. " * 10
CORPUS_BAD = "the cat sat on the hat. the dog sat on the hog. " * 20 + "one two three four five. " * 10
QUESTIONS = [
    ("the cat sat on the", [" mat", " hat", " log"], 0),
    ("the dog sat on the", [" hog", " log", " mat"], 1),
    ("one two three", [" four", " five", " one"], 0),
    ("the cat sat", [" on", " in", " at"], 0),
    ("three four", [" five", " four", " two"], 0),
    ("the dog sat on", [" a", " the", " my"], 1),
]


def write_mc_task(tmp: Path, *, extra: str = "") -> Path:
    """A new benchmark of the multiple-choice shape: only a YAML file and its data."""
    data = tmp / "benchmarks" / "toy_mc"
    data.mkdir(parents=True, exist_ok=True)
    with (data / "test.jsonl").open("w") as handle:
        for i, (q, choices, gold) in enumerate(QUESTIONS * 5):
            handle.write(json.dumps({"id": f"q{i}", "text": q, "options": choices, "label": gold}) + "\n")
    path = tmp / "toy_mc.yaml"
    path.write_text(
        "name: toy_mc\n"
        "output_type: multiple_choice\n"
        "dataset: {path: toy_mc/test.jsonl}\n"
        "template:\n"
        "  id: '{{ id }}'\n"
        "  prompt: '{{ text }}'\n"
        "  choices: ['{{ options[0] }}', '{{ options[1] }}', '{{ options[2] }}']\n"
        "  gold: '{{ label }}'\n"
        "scorer: {name: multiple_choice_loglikelihood}\n"
        "gate: {metrics: [acc], tolerance: 0.0}\n" + extra
    )
    return path


def write_gen_task(tmp: Path) -> Path:
    data = tmp / "benchmarks" / "toy_gen"
    data.mkdir(parents=True, exist_ok=True)
    rows = [{"q": "the cat sat", "a": "on"}, {"q": "one two", "a": "three"}, {"q": "the dog", "a": "barks"}]
    (data / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = tmp / "toy_gen.yaml"
    path.write_text(
        "name: toy_gen\noutput_type: generate_until\ndataset: {path: toy_gen/test.jsonl}\n"
        "template: {prompt: '{{ q }} ', target: '{{ a }}'}\n"
        "generation: {max_tokens: 12, stop: [' ']}\nscorer: {name: exact_match}\n"
    )
    return path


@pytest.fixture
def roots(tmp_path: Path) -> DataRoots:
    return DataRoots(tmp_path / "benchmarks", resolve_data_path("corpora"))


@pytest.fixture
def state() -> EndpointState:
    return EndpointState(models={"toy": NGramModel(CORPUS_GOOD), "toy-bad": NGramModel(CORPUS_BAD)})


BackendFactory = Callable[..., OpenAIBackend]


@pytest.fixture
async def backend_factory(state: EndpointState, tmp_path: Path) -> AsyncIterator[BackendFactory]:
    made: list[OpenAIBackend] = []
    cache = ResponseCache(tmp_path / "cache.sqlite")

    def make(
        model: str = "toy", *, batch_size: int = 16, concurrency: int = 4, use_cache: bool = True
    ) -> OpenAIBackend:
        backend = OpenAIBackend(
            "http://toy",
            model,
            cache=cache if use_cache else None,
            batch_size=batch_size,
            concurrency=concurrency,
            transport=httpx.ASGITransport(app=make_app(state)),
            sleep=lambda _s: _noop(),
        )
        made.append(backend)
        return backend

    yield make
    for backend in made:
        await backend.aclose()
    cache.close()


async def _noop() -> None:
    return None


async def test_multiple_choice_scores_from_real_prompt_logprobs(
    tmp_path: Path, roots: DataRoots, backend_factory: BackendFactory
) -> None:
    task = load_task(str(write_mc_task(tmp_path)))
    backend = backend_factory()
    result = await run_task(task, roots, backend, await backend.identity())
    model = NGramModel(CORPUS_GOOD)
    for sample in result.samples:
        expected = [model.logprob(sample["prompt"], c) for c in sample["choices"]]
        got = [c["logprob"] for c in sample["response"]["choices"]]
        assert got == pytest.approx(expected, abs=1e-9)
        best = max(range(3), key=lambda i: expected[i])
        assert sample["scores"]["acc"] == float(best == sample["gold"])
    assert result.summary["metric"] == "acc"
    assert result.summary["score"] == pytest.approx(1.0)  # the good corpus answers every toy question
    assert result.summary["ci_low"] <= result.summary["score"] <= result.summary["ci_high"]


async def test_rerun_makes_no_model_calls_and_matches(
    tmp_path: Path, roots: DataRoots, backend_factory: BackendFactory, state: EndpointState
) -> None:
    task = load_task(str(write_mc_task(tmp_path)))
    first_backend = backend_factory()
    first = await run_task(task, roots, first_backend, await first_backend.identity())
    calls_after_first = state.completion_requests
    assert calls_after_first > 0
    again = backend_factory()
    second = await run_task(task, roots, again, await again.identity())
    assert state.completion_requests == calls_after_first
    assert again.stats.model_calls == 0 and again.stats.cache_hits == len(first.samples) * 3
    assert (second.spec_hash, second.samples, second.summary) == (
        first.spec_hash,
        first.samples,
        first.summary,
    )


async def test_cache_is_keyed_by_model_identity(
    tmp_path: Path, roots: DataRoots, backend_factory: BackendFactory, state: EndpointState
) -> None:
    """The same name serving another checkpoint must not read the old checkpoint's answers."""
    task = load_task(str(write_mc_task(tmp_path)))
    backend = backend_factory()
    first = await run_task(task, roots, backend, await backend.identity())
    state.models["toy"] = NGramModel(CORPUS_BAD)
    state.roots["toy"] = "checkpoints/toy-step-2000"
    swapped = backend_factory()
    second = await run_task(task, roots, swapped, await swapped.identity())
    assert swapped.stats.cache_hits == 0 and swapped.stats.prompts_sent == len(first.samples) * 3
    assert second.spec_hash != first.spec_hash
    assert second.summary["score"] < first.summary["score"]


async def test_results_do_not_depend_on_batch_size(
    tmp_path: Path, roots: DataRoots, backend_factory: BackendFactory
) -> None:
    task = load_task(str(write_mc_task(tmp_path)))
    one = backend_factory(batch_size=1, concurrency=1, use_cache=False)
    sixteen = backend_factory(batch_size=16, concurrency=8, use_cache=False)
    a = await run_task(task, roots, one, await one.identity())
    b = await run_task(task, roots, sixteen, await sixteen.identity())
    assert set(one.stats.per_batch) == {1} and max(sixteen.stats.per_batch) == 16
    assert (a.spec_hash, a.samples, a.summary) == (b.spec_hash, b.samples, b.summary)


async def test_an_endpoint_without_batched_prompts_gets_one_prompt_per_request(
    tmp_path: Path, roots: DataRoots, backend_factory: BackendFactory, state: EndpointState
) -> None:
    task = load_task(str(write_mc_task(tmp_path)))
    expected = await run_task(task, roots, (b := backend_factory(use_cache=False)), await b.identity())
    state.single_prompt_only = True
    single = backend_factory(batch_size=16, use_cache=False)
    got = await run_task(task, roots, single, await single.identity())
    assert set(single.stats.per_batch) == {1} and single.stats.prompts_sent == len(expected.samples) * 3
    assert got.samples == expected.samples


async def test_retries_never_double_count(
    tmp_path: Path, roots: DataRoots, backend_factory: BackendFactory, state: EndpointState
) -> None:
    task = load_task(str(write_mc_task(tmp_path)))
    clean = backend_factory(use_cache=False)
    expected = await run_task(task, roots, clean, await clean.identity())
    state.fail_next = 2
    flaky = backend_factory(use_cache=False)
    got = await run_task(task, roots, flaky, await flaky.identity())
    assert flaky.stats.retries == 2
    assert flaky.stats.prompts_sent == len(expected.samples) * 3
    assert got.samples == expected.samples


async def test_perplexity_matches_the_model(
    roots: DataRoots, backend_factory: BackendFactory, tmp_path: Path
) -> None:
    corpus = tmp_path / "corpora" / "toy"
    corpus.mkdir(parents=True)
    text = "the cat sat on the mat. " * 12
    (corpus / "input.txt").write_text(text)
    path = tmp_path / "ppl.yaml"
    path.write_text(
        "name: toy_ppl\noutput_type: loglikelihood_rolling\n"
        "dataset: {root: corpora, path: toy/input.txt, format: text, chunk_chars: 96}\n"
        "template: {prompt: '{{ text }}'}\nscorer: {name: perplexity}\n"
    )
    backend = backend_factory()
    result = await run_task(
        load_task(str(path)),
        DataRoots(roots.benchmarks, tmp_path / "corpora"),
        backend,
        await backend.identity(),
    )
    model = NGramModel(CORPUS_GOOD)
    chunks = [text[i : i + 96] for i in range(0, len(text), 96)]
    nll = -sum(model.logprob(c[0], c[1:]) for c in chunks)
    n_bytes = sum(len(c) - 1 for c in chunks)
    assert result.summary["corpus"]["byte_perplexity"] == pytest.approx(math.exp(nll / n_bytes))
    assert result.summary["metrics"]["bits_per_byte"]["higher_is_better"] is False


async def test_perplexity_documents_longer_than_the_context_are_scored_in_windows(
    roots: DataRoots, backend_factory: BackendFactory, state: EndpointState, tmp_path: Path
) -> None:
    corpus = tmp_path / "corpora" / "toy"
    corpus.mkdir(parents=True)
    text = "the cat sat on the mat. " * 12
    (corpus / "input.txt").write_text(text)
    path = tmp_path / "ppl.yaml"
    path.write_text(
        "name: toy_ppl\noutput_type: loglikelihood_rolling\n"
        "dataset: {root: corpora, path: toy/input.txt, format: text, chunk_chars: 96}\n"
        "template: {prompt: '{{ text }}'}\nscorer: {name: perplexity}\n"
    )
    state.max_model_len = 40  # a 96-character document does not fit: 3 windows of 32 characters
    backend = backend_factory()
    result = await run_task(
        load_task(str(path)),
        DataRoots(roots.benchmarks, tmp_path / "corpora"),
        backend,
        await backend.identity(),
    )
    assert result.spec["window_bytes"] == 38
    model = NGramModel(CORPUS_GOOD)
    docs = [text[i : i + 96] for i in range(0, len(text), 96)]
    for doc, sample in zip(docs, result.samples, strict=True):
        pieces = windows(doc, 38)
        assert [len(p) for p in pieces] == [32, 32, 32] and "".join(pieces) == doc
        nll = -sum(model.logprob(w[0], w[1:]) for w in pieces)
        assert sample["scores"]["bits_per_byte"] == pytest.approx(nll / (96 - 3) / math.log(2))
    assert backend.stats.prompts_sent == 3 * len(docs)


def test_windows_cut_on_characters_within_the_byte_budget() -> None:
    assert windows("abc", 0) == ["abc"] and windows("abc", 3) == ["abc"]
    pieces = windows("é" * 10, 7)  # 20 bytes; 3 characters (6 bytes) fit a window, so 4 windows
    assert "".join(pieces) == "é" * 10 and [len(p) for p in pieces] == [2, 3, 3, 2]


async def test_generation_and_rescoring_without_model_calls(
    tmp_path: Path, roots: DataRoots, backend_factory: BackendFactory, state: EndpointState
) -> None:
    task = load_task(str(write_gen_task(tmp_path)))
    backend = backend_factory()
    result = await run_task(task, roots, backend, await backend.identity())
    model = NGramModel(CORPUS_GOOD)
    for sample in result.samples:
        greedy = ""
        for _ in range(12):
            greedy += model.greedy_char(sample["prompt"] + greedy)
        assert sample["response"]["texts"][0] == greedy.split(" ")[0]
        assert sample["scores"]["exact_match"] == float(greedy.split(" ")[0] == sample["target"])
    assert [s["scores"]["exact_match"] for s in result.samples] == [1.0, 0.0, 0.0]
    calls = state.completion_requests
    new_scorer = task.model_copy(update={"scorer": task.scorer.model_copy(update={"name": "gsm8k"})})
    rescored = rescore_task(new_scorer, result.spec, result.samples)
    assert state.completion_requests == calls
    assert rescored.spec_hash != result.spec_hash
    assert set(rescored.summary["metrics"]) == {"exact_match_strict", "exact_match_flexible"}
    changed = task.model_copy(update={"generation": task.generation.model_copy(update={"max_tokens": 5})})
    with pytest.raises(errors.ValidationError, match="generation"):
        rescore_task(changed, result.spec, result.samples)


async def _run_dir(task_path: Path, roots: DataRoots, backend: OpenAIBackend, out: Path) -> dict[str, Any]:
    result = await run_task(load_task(str(task_path)), roots, backend, await backend.identity())
    return write_run(out, [result], {"model": {"name": backend.model}})


async def test_compare_flags_a_regression_and_blocks(
    tmp_path: Path, roots: DataRoots, backend_factory: BackendFactory
) -> None:
    task = write_mc_task(tmp_path)
    await _run_dir(task, roots, backend_factory("toy"), tmp_path / "good")
    await _run_dir(task, roots, backend_factory("toy-bad"), tmp_path / "bad")
    summary = json.loads((tmp_path / "good" / "summary.json").read_text())
    assert {"score", "stderr", "ci_low", "ci_high"} <= set(summary["tasks"]["toy_mc"]) and summary[
        "spec_hash"
    ]
    blocked = compare_runs(tmp_path / "good", tmp_path / "bad", resamples=2000)
    row = blocked.rows[0]
    assert not blocked.passed and row.regression and row.result.delta < 0 and row.result.test == "mcnemar"
    assert row.result.ci_high < 0
    same = compare_runs(tmp_path / "good", tmp_path / "good", resamples=2000)
    assert same.passed and same.rows[0].result.delta == 0
    improved = compare_runs(tmp_path / "bad", tmp_path / "good", resamples=2000)
    assert improved.passed and improved.rows[0].result.delta > 0
    samples = read_samples(tmp_path / "good", "toy_mc")
    assert len(samples) == len(QUESTIONS) * 5 and "prompt" in samples[0] and "extracted" in samples[0]


async def test_compare_refuses_runs_with_different_specs(
    tmp_path: Path, roots: DataRoots, backend_factory: BackendFactory
) -> None:
    await _run_dir(write_mc_task(tmp_path), roots, backend_factory(), tmp_path / "a")
    other = write_mc_task(tmp_path, extra="fewshot: {num: 1, seed: 7}\n")
    await _run_dir(other, roots, backend_factory(), tmp_path / "b")
    with pytest.raises(errors.ConflictError, match=r"task\.fewshot"):
        compare_runs(tmp_path / "a", tmp_path / "b")


async def test_the_service_runs_a_shipped_task_through_the_harness(
    tmp_path: Path, db: Database, catalog: BenchmarkCatalog, state: EndpointState
) -> None:
    """RunSuite → worker → TaskSuiteRunner → harness → stored per-example results and metrics."""
    from forge_eval.registry import ModelRegistry
    from forge_eval.runs import RunService
    from forge_eval.store.runs import RunStatus
    from forge_eval.task_runner import TaskSuiteRunner

    state.models["toy:1"] = state.models["toy"]
    runner = TaskSuiteRunner(
        DataRoots(catalog.root, resolve_data_path("corpora")),
        cache_path=tmp_path / "cache.sqlite",
        transport=httpx.ASGITransport(app=make_app(state)),
    )
    runs = RunService(db, catalog, runner, default_endpoint="http://toy")
    await ModelRegistry(db).register_model("toy", "1", "file:///ckpt/toy", {})
    queued = await runs.run_suite("bbh", "toy", "1", endpoint="", limit=6, seed=2, options={})
    assert queued.spec["scorer_version"].startswith("exact-match-1+task-")
    assert await runs.claim_next_run() == queued.id
    run = await runs.execute_run(queued.id)
    assert run.status == RunStatus.SUCCEEDED, run.error
    _, metrics = await runs.get_run(queued.id)
    assert [m.name for m in metrics] == ["exact_match"] and metrics[0].n == 6
    assert state.prompts == 6


def test_service_gate_uses_the_tolerance_and_the_metric_direction() -> None:
    from forge_eval import stats
    from forge_eval.gate import MetricDelta, Verdict, verdict_of

    drop = stats.PairedResult(0.50, 0.48, -0.02, -0.03, -0.01, 0.01, 1000, "mcnemar")
    assert verdict_of((MetricDelta("acc", drop),), 0.0) == Verdict.WORSE
    assert verdict_of((MetricDelta("acc", drop),), 0.05) == Verdict.NO_DIFFERENCE
    # Fewer bits per byte is better: the same numbers are an improvement there.
    assert verdict_of((MetricDelta("bits_per_byte", drop),), 0.0) == Verdict.BETTER


async def test_humaneval_runs_generated_code_in_the_sandbox(backend_factory: BackendFactory) -> None:
    """The shipped HumanEval task end to end: greedy completions from the toy model, executed."""
    roots = DataRoots(resolve_data_path("benchmarks"), resolve_data_path("corpora"))
    backend = backend_factory()
    result = await run_task(load_task("humaneval"), roots, backend, await backend.identity(), limit=2, seed=4)
    assert [s["id"].split("/")[0] for s in result.samples] == ["HumanEval", "HumanEval"]
    for sample in result.samples:
        # Character trigrams of English do not write Python that passes the tests.
        assert sample["scores"] == {"pass@1": 0.0}
        assert sample["extracted"]["pass@1"] in {"failed", "timeout"}
    assert result.summary["metric"] == "pass@1"


async def test_humaneval_refuses_to_run_without_a_sandbox(
    backend_factory: BackendFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No bubblewrap: the run fails with a clear error before any completion is generated."""
    from forge_kit.sandbox import SandboxUnavailableError

    monkeypatch.setenv("FORGE_SANDBOX_BWRAP", "/nonexistent/bwrap")
    roots = DataRoots(resolve_data_path("benchmarks"), resolve_data_path("corpora"))
    backend = backend_factory()
    with pytest.raises(SandboxUnavailableError, match="code execution is refused"):
        await run_task(load_task("humaneval"), roots, backend, await backend.identity(), limit=2, seed=4)
