"""The eval harness: run YAML tasks against a backend, write a run folder, re-score it, compare two.

A run folder holds ``summary.json`` (spec hashes, per-task scores with standard error and
bootstrap interval, call statistics), ``samples/<task>.jsonl`` (per example: prompt, target, the
model's response, extracted answers and scores) and ``report.md``. Everything that decides a
task's result is in its spec — task config with templates and decoding, dataset and few-shot
hashes, the few-shot selection, the example ids, the model identity and the scorer version — and
the spec hash is the sha256 of its canonical JSON.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from forge_eval import stats
from forge_eval.backend import (
    Continuation,
    ModelIdentity,
    OpenAIBackend,
    Request,
    continuation_loglikelihood,
    continuation_requests,
    generate_request,
    logprob_request,
    rolling_loglikelihood,
    texts,
)
from forge_eval.scorers import Scorer, corpus_bleu4, corpus_perplexity, get_scorer
from forge_eval.tasks import DataRoots, Doc, TaskConfig, build_docs, dataset_hash
from forge_kit import errors, sandbox

SUMMARY = "summary.json"
ALPHA = 0.05
#: Task-config keys that do not change results and so stay out of the spec hash.
UNHASHED = frozenset({"description", "gate"})


def _sha(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class TaskRun:
    """One task's results: its spec, per-example samples and per-metric summaries."""

    name: str
    spec: dict[str, Any]
    spec_hash: str
    samples: list[dict[str, Any]]
    summary: dict[str, Any]
    gate: dict[str, Any]


def task_spec(
    task: TaskConfig,
    roots: DataRoots,
    docs: Sequence[Doc],
    identity: ModelIdentity,
    scorer: Scorer,
    *,
    limit: int,
    seed: int,
    smoke: bool,
    window_bytes: int = 0,
) -> dict[str, Any]:
    """Everything that decides ``task``'s results on this model, as plain JSON."""
    config = {k: v for k, v in task.model_dump(mode="json").items() if k not in UNHASHED}
    fewshot_ds = task.fewshot.dataset
    return {
        "task": config,
        "dataset_sha256": dataset_hash(roots, task.dataset),
        "fewshot_sha256": dataset_hash(roots, fewshot_ds, "task.fewshot.dataset") if fewshot_ds else "",
        "fewshot_selection_sha256": _sha([[d.id, list(d.shots)] for d in docs]),
        "example_ids_sha256": _sha([d.id for d in docs]),
        "model": asdict(identity),
        "scorer": {"name": scorer.name, "version": scorer.version},
        "limit": limit,
        "seed": seed,
        "smoke": smoke,
        "window_bytes": window_bytes,
        **({"images_sha256": _sha([[d.id, d.image_sha256] for d in docs])} if task.template.image else {}),
    }


def windows(text: str, max_bytes: int) -> list[str]:
    """``text`` cut on character boundaries into the fewest pieces of near-equal length that each
    fit in ``max_bytes`` UTF-8 bytes (so no piece is a stub); the whole text when it fits."""
    total = len(text.encode())
    if max_bytes <= 0 or total <= max_bytes:
        return [text]
    count = math.ceil(total / max_bytes)
    while True:
        bounds = [round(i * len(text) / count) for i in range(count + 1)]
        pieces = [text[lo:hi] for lo, hi in itertools.pairwise(bounds)]
        if all(len(p.encode()) <= max_bytes for p in pieces):
            return pieces
        count += 1


def rolling_window_bytes(task: TaskConfig, docs: Sequence[Doc], max_model_len: int | None) -> int:
    """For a perplexity task whose documents exceed the served model's context, the window size
    in bytes that any byte-level tokenizer fits in it (each token covers at least one byte; one
    position for a start token, one for the generated token); 0 when no document needs it."""
    if task.output_type != "loglikelihood_rolling" or not max_model_len:
        return 0
    limit = max(1, max_model_len - 2)
    return limit if any(len(d.prompt.encode()) > limit for d in docs) else 0


def _requests(
    task: TaskConfig, docs: Sequence[Doc], model: str, seed: int, window_bytes: int = 0
) -> list[list[Request]]:
    """The requests of every doc (several per doc for multiple choice, and for a perplexity
    document longer than the model's context, one per window)."""
    gen = task.generation.model_dump()
    if task.output_type in ("generate_until", "code_exec"):
        send = task.images == "send"
        return [
            [generate_request(model, d.prompt, gen, seed, chat=task.chat, image=d.image if send else b"")]
            for d in docs
        ]
    return [[logprob_request(model, w) for w in windows(d.prompt, window_bytes)] for d in docs]


Spans = list[list[tuple[int, int]]]
"""Per doc and choice: the context's token count and the prompt's (the continuation between)."""


async def _choice_requests(
    docs: Sequence[Doc], backend: OpenAIBackend, identity: ModelIdentity, delimiter: str = ""
) -> tuple[list[list[Request]], Spans]:
    """Every choice of every doc (after ``delimiter``) as a token-id logprob request, split into
    context and continuation by the served model's tokenizer as lm-evaluation-harness splits them."""
    pairs = [[Continuation.split(d.prompt, delimiter + c) for c in d.choices] for d in docs]
    texts_needed = sorted(
        {t for ps in pairs for p in ps for t in (p.context, p.context + p.continuation) if t}
    )
    tokens = dict(zip(texts_needed, await backend.tokenize(texts_needed, identity), strict=True))
    per_doc, spans = [], []
    for ps in pairs:
        planned = continuation_requests(backend.model, ps, tokens)
        per_doc.append([r for r, _, _ in planned])
        spans.append([(context, whole) for _, context, whole in planned])
    return per_doc, spans


def _parse(
    task: TaskConfig, doc: Doc, raw: list[dict[str, Any]], spans: list[tuple[int, int]], window_bytes: int = 0
) -> dict[str, Any]:
    """The scorer's input from the raw responses of one doc; a windowed document's
    log-likelihood, tokens, bytes and words are the sums over its windows (each window's first
    token is unscored: it has no context)."""
    if task.output_type in ("generate_until", "code_exec"):
        return {"texts": texts(raw[0])}
    if task.output_type == "multiple_choice":
        return {"choices": [continuation_loglikelihood(r, *span) for r, span in zip(raw, spans, strict=True)]}
    parts = [rolling_loglikelihood(r, w) for r, w in zip(raw, windows(doc.prompt, window_bytes), strict=True)]
    if len(parts) == 1:
        return parts[0]
    return {key: sum(p[key] for p in parts) for key in ("logprob", "tokens", "bytes", "words")}


def _score(task: TaskConfig, scorer: Scorer, doc: Doc, response: dict[str, Any]) -> dict[str, Any]:
    scores = scorer.score(doc, response, dict(task.scorer.options))
    return {
        "id": doc.id,
        "prompt": doc.prompt,
        "target": doc.target,
        "choices": list(doc.choices),
        "gold": doc.gold,
        **({"golds": list(doc.golds)} if len(doc.golds) > 1 else {}),
        **({"targets": list(doc.targets)} if doc.targets else {}),
        "record": doc.record,
        "shots": list(doc.shots),
        "response": response,
        "extracted": {s.metric: s.extracted for s in scores},
        "scores": {s.metric: s.score for s in scores},
    }


def summarize(samples: Sequence[dict[str, Any]], scorer: Scorer, seed: int) -> dict[str, Any]:
    """Per metric: mean, standard error and seeded bootstrap 95% interval; the task's headline
    ``score``/``stderr``/``ci_low``/``ci_high`` are those of the scorer's primary metric."""
    metrics: dict[str, Any] = {}
    for metric in sorted({m for s in samples for m in s["scores"]}):
        values = [float(s["scores"][metric]) for s in samples if metric in s["scores"]]
        est = stats.mean_estimate(values, seed=seed)
        metrics[metric] = {
            "score": est.value,
            "stderr": stats.standard_error(values),
            "ci_low": est.ci_low,
            "ci_high": est.ci_high,
            "n": est.n,
            "higher_is_better": scorer.higher_is_better.get(metric, True),
        }
    primary: dict[str, Any] = metrics.get(scorer.primary) or next(iter(metrics.values()), {})
    out: dict[str, Any] = {
        "metric": scorer.primary,
        "score": primary.get("score", math.nan),
        "stderr": primary.get("stderr", math.nan),
        "ci_low": primary.get("ci_low", math.nan),
        "ci_high": primary.get("ci_high", math.nan),
        "n": len(samples),
        "metrics": metrics,
    }
    if scorer.output_type == "loglikelihood_rolling" and samples:
        out["corpus"] = corpus_perplexity([s["response"] for s in samples])
    if scorer.name == "caption_bleu4" and samples:
        out["corpus"] = corpus_bleu4(samples)
    return out


async def run_task(
    task: TaskConfig,
    roots: DataRoots,
    backend: OpenAIBackend,
    identity: ModelIdentity,
    *,
    limit: int = 0,
    seed: int = 0,
    smoke: bool = False,
) -> TaskRun:
    """Evaluate one task.

    1. Check the scorer fits the task (and, for code execution, that a sandbox can be had: else
    :class:`~forge_kit.sandbox.SandboxUnavailableError`) and render the docs (data hashes checked, templates strict);
    2. pin the spec (with the perplexity window when documents exceed the model's context);
    3. build every request and run them through the backend (cache first); 4. parse and score
    each doc; 5. summarise with standard errors and intervals.
    """
    scorer = get_scorer(task.scorer.name, task.output_type)
    scorer.check(dict(task.scorer.options))
    if task.output_type == "code_exec":
        # Before any generation: without a sandbox the model's code is never run.
        sandbox.check_available()
    docs = build_docs(task, roots, limit=limit, seed=seed, smoke=smoke)
    if not docs:
        raise errors.ValidationError("task.dataset", "selects no examples")
    window = rolling_window_bytes(task, docs, backend.max_model_len)
    spec = task_spec(
        task, roots, docs, identity, scorer, limit=limit, seed=seed, smoke=smoke, window_bytes=window
    )
    if task.output_type == "multiple_choice":
        per_doc, spans = await _choice_requests(docs, backend, identity, task.template.delimiter)
    else:
        per_doc, spans = _requests(task, docs, backend.model, seed, window), [[] for _ in docs]
    flat = [r for rs in per_doc for r in rs]
    answers = await backend.run(flat, identity)
    samples, at = [], 0
    for doc, rs, span in zip(docs, per_doc, spans, strict=True):
        raw = answers[at : at + len(rs)]
        at += len(rs)
        samples.append(_score(task, scorer, doc, _parse(task, doc, raw, span, window)))
    return TaskRun(
        task.name,
        spec,
        _sha(spec),
        samples,
        summarize(samples, scorer, seed),
        task.gate.model_dump(mode="json"),
    )


def rescore_task(
    task: TaskConfig, old_spec: dict[str, Any], old_samples: Sequence[dict[str, Any]]
) -> TaskRun:
    """Re-score stored responses with ``task``'s (new) scorer: no generation. Refused when
    anything but the scorer differs, since then the stored responses are not this task's."""
    scorer = get_scorer(task.scorer.name, task.output_type)
    new_config = {k: v for k, v in task.model_dump(mode="json").items() if k not in UNHASHED}
    old_config = dict(old_spec["task"])
    differing = sorted(
        k
        for k in new_config.keys() | old_config.keys()
        if k != "scorer" and new_config.get(k) != old_config.get(k)
    )
    if differing:
        raise errors.ValidationError(
            "task", f"differs from the stored run in {', '.join(differing)}; only the scorer may change"
        )
    samples = []
    for s in old_samples:
        doc = Doc(
            s["id"],
            s["prompt"],
            s["target"],
            tuple(s["choices"]),
            s["gold"],
            s["record"],
            tuple(s["shots"]),
            golds=tuple(s.get("golds", ())),
            targets=tuple(s.get("targets", ())),
        )
        samples.append(_score(task, scorer, doc, s["response"]))
    spec = {**old_spec, "task": new_config, "scorer": {"name": scorer.name, "version": scorer.version}}
    summary = summarize(samples, scorer, int(old_spec["seed"]))
    return TaskRun(task.name, spec, _sha(spec), samples, summary, task.gate.model_dump(mode="json"))


# --- run folders -------------------------------------------------------------------------------


def write_run(out: Path, runs: Sequence[TaskRun], extra: dict[str, Any]) -> dict[str, Any]:
    """Write samples, ``summary.json`` and ``report.md``; the run's ``spec_hash`` covers all tasks."""
    (out / "samples").mkdir(parents=True, exist_ok=True)
    for run in runs:
        with (out / "samples" / f"{run.name}.jsonl").open("w") as handle:
            for sample in run.samples:
                handle.write(json.dumps(sample, sort_keys=True) + "\n")
    summary = {
        "spec_hash": _sha({r.name: r.spec_hash for r in runs}),
        "tasks": {r.name: {"spec_hash": r.spec_hash, "gate": r.gate, **r.summary} for r in runs},
        "specs": {r.name: r.spec for r in runs},
        **extra,
    }
    (out / SUMMARY).write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    (out / "report.md").write_text(run_report(summary))
    return summary


def read_run(folder: Path) -> dict[str, Any]:
    path = folder / SUMMARY
    if not path.is_file():
        raise errors.ValidationError("run", f"{folder} is not a run folder: it has no {SUMMARY}")
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def read_samples(folder: Path, task: str) -> list[dict[str, Any]]:
    path = folder / "samples" / f"{task}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _fmt(x: float) -> str:
    return "nan" if x != x else f"{x:.4f}"


def run_report(summary: dict[str, Any]) -> str:
    """Markdown: per task and metric, the score, its standard error and 95% interval. Call counts
    and timings stay in ``summary.json`` so a cached re-run writes an identical report."""
    lines = [
        "# Eval run",
        "",
        f"- spec hash: `{summary['spec_hash']}`",
        f"- model: `{summary.get('model', {}).get('name', '')}` "
        f"(checkpoint `{summary.get('model', {}).get('checkpoint_sha256', '')[:16]}`, "
        f"{summary.get('model', {}).get('source', '')})",
        f"- tier: {'smoke (stratified subsets: wider intervals)' if any(s.get('smoke') for s in summary['specs'].values()) else 'full'}",
        "",
        "| task | metric | n | score | stderr | 95% interval |",
        "|---|---|---:|---:|---:|---|",
    ]
    for name, task in sorted(summary["tasks"].items()):
        for metric, m in task["metrics"].items():
            lines.append(
                f"| {name} | {metric} | {m['n']} | {_fmt(m['score'])} | {_fmt(m['stderr'])} | "
                f"[{_fmt(m['ci_low'])}, {_fmt(m['ci_high'])}] |"
            )
        for key, value in task.get("corpus", {}).items():
            lines.append(f"| {name} | {key} (corpus) | {task['n']} | {_fmt(value)} | | |")
    return "\n".join(lines) + "\n"


# --- comparison and the gate -------------------------------------------------------------------


@dataclass(frozen=True)
class GateRow:
    task: str
    metric: str
    result: stats.PairedResult
    tolerance: float
    higher_is_better: bool
    regression: bool


@dataclass(frozen=True)
class GateDecision:
    rows: tuple[GateRow, ...]
    comparisons: int
    confidence: float
    passed: bool


def spec_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Spec keys (model excluded: comparisons pair models) whose values differ, for messages."""
    out = []
    for key in sorted(a.keys() | b.keys()):
        if key == "model":
            continue
        if key == "task":
            sub = a.get("task", {}), b.get("task", {})
            out += [
                f"task.{k}" for k in sorted(sub[0].keys() | sub[1].keys()) if sub[0].get(k) != sub[1].get(k)
            ]
        elif a.get(key) != b.get(key):
            out.append(key)
    return out


def compare_runs(
    baseline: Path,
    candidate: Path,
    *,
    tolerances: dict[str, float] | None = None,
    gate_metrics: Callable[[str, dict[str, Any]], Sequence[str]] | None = None,
    resamples: int = 10_000,
) -> GateDecision:
    """Paired comparison of two run folders and the release-gate decision.

    1. Refuse unless both ran the same tasks with the same specs (apart from the model), naming
    what differs; 2. per task and gated metric pair the examples by id; 3. paired bootstrap of the
    difference at confidence 1 − 0.05/m (Bonferroni over the m gated comparisons) and McNemar's
    exact test (sign-flip for non-binary scores); 4. a regression is an interval whose upper bound
    (in the better direction) is below −tolerance; the gate passes when no metric regressed.
    """
    a, b = read_run(baseline), read_run(candidate)
    if set(a["tasks"]) != set(b["tasks"]):
        raise errors.ConflictError(
            f"the runs evaluated different tasks: {sorted(a['tasks'])} vs {sorted(b['tasks'])}"
        )
    for name in sorted(a["tasks"]):
        differing = spec_differences(a["specs"][name], b["specs"][name])
        if differing:
            raise errors.ConflictError(
                f"task {name}: the runs' specs differ in {', '.join(differing)}; not comparable"
            )
    plan: list[tuple[str, str, float]] = []
    for name, task in sorted(a["tasks"].items()):
        spec_gate = b["tasks"][name].get("gate") or {}
        metrics = list(
            gate_metrics(name, task) if gate_metrics else spec_gate.get("metrics") or [task["metric"]]
        )
        tol = (tolerances or {}).get(name, float(spec_gate.get("tolerance", 0.0)))
        plan += [(name, m, tol) for m in metrics]
    confidence = 1 - ALPHA / max(1, len(plan))
    rows = []
    for name, metric, tol in plan:
        sa = {s["id"]: s["scores"] for s in read_samples(baseline, name)}
        sb = {s["id"]: s["scores"] for s in read_samples(candidate, name)}
        ids = sorted(i for i in sa.keys() & sb.keys() if metric in sa[i] and metric in sb[i])
        seed = int(a["specs"][name]["seed"])
        result = stats.paired_compare(
            [float(sa[i][metric]) for i in ids],
            [float(sb[i][metric]) for i in ids],
            seed=seed,
            resamples=resamples,
            confidence=confidence,
        )
        higher = bool(a["tasks"][name]["metrics"].get(metric, {}).get("higher_is_better", True))
        worst_case_gain = result.ci_high if higher else -result.ci_low
        rows.append(GateRow(name, metric, result, tol, higher, worst_case_gain < -tol))
    return GateDecision(tuple(rows), len(plan), confidence, not any(r.regression for r in rows))


def comparison_report(decision: GateDecision) -> str:
    lines = [
        f"| task | metric | n | baseline | candidate | delta | {decision.confidence:.2%} interval | p ({'test'}) | tolerance | regression |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    for r in decision.rows:
        x = r.result
        lines.append(
            f"| {r.task} | {r.metric}{'' if r.higher_is_better else ' (lower is better)'} | {x.n} | {_fmt(x.baseline)} | "
            f"{_fmt(x.candidate)} | {x.delta:+.4f} | [{x.ci_low:+.4f}, {x.ci_high:+.4f}] | {x.p_value:.4g} ({x.test}) | "
            f"{r.tolerance:g} | {'YES' if r.regression else 'no'} |"
        )
    verdict = "PASS" if decision.passed else "BLOCK"
    lines += ["", f"gate: {verdict} ({decision.comparisons} comparisons, Bonferroni-adjusted intervals)"]
    return "\n".join(lines) + "\n"


def plot_deltas(decision: GateDecision, path: Path) -> None:
    """A forest plot of the paired deltas with their (Bonferroni-adjusted) intervals and the
    tolerance line: regressions in red."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = decision.rows
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(rows) + 1.5))
    for y, r in enumerate(rows):
        x = r.result
        color = "tab:red" if r.regression else "tab:blue"
        ax.plot([x.ci_low, x.ci_high], [y, y], color=color, linewidth=2)
        ax.plot([x.delta], [y], "o", color=color)
        sign = -1 if r.higher_is_better else 1
        ax.plot([sign * r.tolerance], [y], "|", color="gray", markersize=14)
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(rows)), [f"{r.task}/{r.metric}" for r in rows])
    ax.set_xlabel(f"candidate − baseline ({decision.confidence:.2%} paired-bootstrap interval)")
    ax.set_title(f"gate: {'PASS' if decision.passed else 'BLOCK'}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
