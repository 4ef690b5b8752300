"""Scorers: from a model's raw response for one example to per-metric scores.

A scorer never calls the model: it reads the raw response the harness stored (texts, or
log-likelihoods), so stored predictions can be re-scored by a new scorer version without any
generation. Its ``version`` goes into the run-spec hash; change it whenever a score could change.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from forge_eval.tasks import Doc, OutputType
from forge_kit import errors, sandbox

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_STRICT = re.compile(r"####\s*(-?\d[\d,]*(?:\.\d+)?)")


@dataclass(frozen=True)
class MetricScore:
    """One example's score for one metric and the answer it was computed from."""

    metric: str
    score: float
    extracted: str = ""


@dataclass(frozen=True)
class Scorer:
    """A named, versioned scoring function and which direction of each metric is better."""

    name: str
    version: str
    output_type: OutputType
    higher_is_better: Mapping[str, bool]
    primary: str
    fn: Callable[[Doc, dict[str, Any], dict[str, Any]], list[MetricScore]]
    check_options: Callable[[dict[str, Any]], None] | None = None
    """Refuses bad ``task.scorer.options`` before any model call (ValidationError naming them)."""

    def check(self, options: dict[str, Any]) -> None:
        if self.check_options is not None:
            self.check_options(options)

    def score(self, doc: Doc, response: dict[str, Any], options: dict[str, Any]) -> list[MetricScore]:
        return self.fn(doc, response, options)


def _number(text: str) -> str:
    return text.replace(",", "").rstrip(".")


def _gsm8k(doc: Doc, response: dict[str, Any], options: dict[str, Any]) -> list[MetricScore]:
    """Strict: the number after ``####``; flexible: the last number of the first paragraph."""
    output = response["texts"][0]
    strict = _STRICT.search(output)
    strict_answer = _number(strict.group(1)) if strict else ""
    numbers = _NUMBER.findall(output.split("\n\n")[0])
    flexible = _number(numbers[-1]) if numbers else ""
    target = _number(doc.target.strip())
    return [
        MetricScore("exact_match_strict", float(strict_answer == target), strict_answer),
        MetricScore("exact_match_flexible", float(flexible == target), flexible),
    ]


def _exact_match(doc: Doc, response: dict[str, Any], options: dict[str, Any]) -> list[MetricScore]:
    """The first line of the output, stripped of a trailing full stop, equals the target."""
    answer = response["texts"][0].strip().split("\n")[0].strip().rstrip(".")
    return [MetricScore("exact_match", float(answer == doc.target.strip()), answer)]


def _vlm_metrics() -> Any:
    """The VLM metrics of the training library (one copy: ``forge_training.vlm.metrics``, pure
    Python), imported on use: only the image tasks need it (``pip install forge-eval[vlm]``)."""
    try:
        from forge_training.vlm import metrics
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise errors.ValidationError(
            "task.scorer.name", f"the VLM scorers need forge-training (forge-eval[vlm]): {exc}"
        ) from None
    return metrics


def _first_line(response: dict[str, Any]) -> str:
    return str(response["texts"][0]).strip().split("\n")[0].strip()


def _vqa(doc: Doc, response: dict[str, Any], options: dict[str, Any]) -> list[MetricScore]:
    """VQA exact match: the first line of the answer equals the target after
    ``forge_training.vlm.metrics.normalise`` (case, punctuation and articles dropped)."""
    answer = _first_line(response)
    return [MetricScore("vqa_exact_match", _vlm_metrics().exact_match(answer, doc.target), answer)]


def _caption(doc: Doc, response: dict[str, Any], options: dict[str, Any]) -> list[MetricScore]:
    """Caption BLEU-4 of the first line against the reference caption, per caption with add-one
    smoothing (``sentence_bleu4``); the corpus BLEU-4 is in the summary's ``corpus``."""
    answer = _first_line(response)
    return [MetricScore("bleu4", _vlm_metrics().sentence_bleu4(answer, doc.target), answer)]


def corpus_bleu4(samples: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Corpus BLEU-4 (Papineni et al.) of the extracted captions against their targets."""
    captions = [str(s["extracted"].get("bleu4", "")) for s in samples]
    return {"bleu4": _vlm_metrics().bleu4(captions, [str(s["target"]) for s in samples])}


def _golds(doc: Doc) -> tuple[int, ...]:
    return doc.golds or (doc.gold,)


def _multiple_choice(doc: Doc, response: dict[str, Any], options: dict[str, Any]) -> list[MetricScore]:
    """lm-evaluation-harness's definitions (ties go to the first choice): acc, the choice of
    highest log-likelihood is a right one; acc_norm, the same per character of the choice;
    acc_bytes, per UTF-8 byte (the task's ``delimiter`` counted in neither)."""
    lls = [float(c["logprob"]) for c in response["choices"]]
    golds = _golds(doc)

    def picked(lengths: list[int]) -> int:
        values = [ll / max(1, n) for ll, n in zip(lls, lengths, strict=True)]
        return max(range(len(values)), key=lambda i: (values[i], -i))

    best = picked([1] * len(lls))
    best_norm = picked([len(c) for c in doc.choices])
    best_bytes = picked([len(c.encode()) for c in doc.choices])
    return [
        MetricScore("acc", float(best in golds), doc.choices[best].strip()),
        MetricScore("acc_norm", float(best_norm in golds), doc.choices[best_norm].strip()),
        MetricScore("acc_bytes", float(best_bytes in golds), doc.choices[best_bytes].strip()),
    ]


def _mc2(doc: Doc, response: dict[str, Any], options: dict[str, Any]) -> list[MetricScore]:
    """TruthfulQA's MC2: the probability mass of the right choices among all choices
    (lm-evaluation-harness's ``truthfulqa_mc2``: ``sum p_true / sum p``)."""
    lls = [float(c["logprob"]) for c in response["choices"]]
    top = max(lls)
    mass = [math.exp(ll - top) for ll in lls]
    golds = _golds(doc)
    value = sum(mass[i] for i in golds) / sum(mass)
    return [MetricScore("mc2", value, f"{value:.6f}")]


#: Characters of a generation a regex is applied to at most.
MAX_EXTRACT_CHARS = 20_000


def _regex_options(options: dict[str, Any]) -> tuple[re.Pattern[str], int, str]:
    """The ``regex`` (required, at most 500 characters), its ``group`` (default: 1 when the
    pattern has groups, else 0) and which match is read (``first`` or ``last``)."""
    pattern = options.get("regex")
    if not isinstance(pattern, str) or not pattern or len(pattern) > 500:
        raise errors.ValidationError(
            "task.scorer.options.regex", "a regular expression of 1 to 500 characters is required"
        )
    try:
        compiled = re.compile(pattern, re.IGNORECASE if options.get("ignore_case") else 0)
    except re.error as exc:
        raise errors.ValidationError(
            "task.scorer.options.regex", f"is not a valid regular expression: {exc}"
        ) from None
    group = options.get("group", 1 if compiled.groups else 0)
    if not isinstance(group, int) or isinstance(group, bool) or not 0 <= group <= compiled.groups:
        raise errors.ValidationError(
            "task.scorer.options.group", f"must be a group of the regex (0 to {compiled.groups})"
        )
    which = options.get("match", "first")
    if which not in ("first", "last"):
        raise errors.ValidationError("task.scorer.options.match", "must be 'first' or 'last'")
    return compiled, group, which


def _check_regex(options: dict[str, Any]) -> None:
    _regex_options(options)


def _normalise(text: str, options: dict[str, Any]) -> str:
    text = text.strip().rstrip(".")
    return text.lower() if options.get("ignore_case") else text


def _regex_match(doc: Doc, response: dict[str, Any], options: dict[str, Any]) -> list[MetricScore]:
    """The answer the regex extracts from the generation (its first or last match, the group
    asked for; empty when none) equals any reference (``template.targets``, else the target),
    both stripped of spaces and a final full stop."""
    compiled, group, which = _regex_options(options)
    found = list(compiled.finditer(str(response["texts"][0])[:MAX_EXTRACT_CHARS]))
    answer = ""
    if found:
        answer = (found[0] if which == "first" else found[-1]).group(group) or ""
    references = doc.targets or (doc.target,)
    hit = any(_normalise(answer, options) == _normalise(r, options) for r in references) if found else False
    return [MetricScore("exact_match", float(hit), answer)]


def _perplexity(doc: Doc, response: dict[str, Any], options: dict[str, Any]) -> list[MetricScore]:
    """Bits per byte and nats per token of the scored text; corpus-level perplexities are
    aggregated from the sums in :func:`corpus_perplexity`."""
    nll = -float(response["logprob"])
    n_bytes = max(1, int(response["bytes"]))
    n_tokens = max(1, int(response["tokens"]))
    return [
        MetricScore("bits_per_byte", nll / n_bytes / math.log(2), f"{nll:.6f}"),
        MetricScore("nll_per_token", nll / n_tokens, str(n_tokens)),
    ]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` passed (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def _humaneval(doc: Doc, response: dict[str, Any], options: dict[str, Any]) -> list[MetricScore]:
    """Run prompt + completion + the tests in the sandbox for every sample; pass@k per k."""
    limits = sandbox.SandboxLimits(timeout_s=float(options.get("timeout_s", 10.0)))
    record = doc.record
    passed = 0
    statuses = []
    for completion in response["texts"]:
        program = f"{record['prompt']}{completion}\n\n{record['test']}\n\ncheck({record['entry_point']})\n"
        result = sandbox.run_python(program, limits)
        passed += result.passed
        statuses.append(result.status)
    n = len(response["texts"])
    ks = [int(k) for k in options.get("k", [1])]
    return [MetricScore(f"pass@{k}", pass_at_k(n, passed, k), ",".join(statuses)) for k in ks if k <= n]


SCORERS: dict[str, Scorer] = {
    s.name: s
    for s in (
        Scorer(
            "gsm8k",
            "gsm8k-extract-1",
            "generate_until",
            {"exact_match_strict": True, "exact_match_flexible": True},
            "exact_match_strict",
            _gsm8k,
        ),
        Scorer(
            "exact_match",
            "exact-match-1",
            "generate_until",
            {"exact_match": True},
            "exact_match",
            _exact_match,
        ),
        Scorer(
            "vqa_exact_match",
            "vqa-exact-match-1",
            "generate_until",
            {"vqa_exact_match": True},
            "vqa_exact_match",
            _vqa,
        ),
        Scorer("caption_bleu4", "caption-bleu4-1", "generate_until", {"bleu4": True}, "bleu4", _caption),
        Scorer(
            "multiple_choice_loglikelihood",
            "mc-loglik-2",
            "multiple_choice",
            {"acc": True, "acc_norm": True, "acc_bytes": True},
            "acc",
            _multiple_choice,
        ),
        Scorer("multiple_choice_mc2", "mc2-1", "multiple_choice", {"mc2": True}, "mc2", _mc2),
        Scorer(
            "regex_match",
            "regex-match-1",
            "generate_until",
            {"exact_match": True},
            "exact_match",
            _regex_match,
            _check_regex,
        ),
        Scorer(
            "perplexity",
            "perplexity-1",
            "loglikelihood_rolling",
            {"bits_per_byte": False, "nll_per_token": False},
            "bits_per_byte",
            _perplexity,
        ),
        Scorer(
            "humaneval",
            "humaneval-sandbox-1",
            "code_exec",
            {"pass@1": True, "pass@10": True},
            "pass@1",
            _humaneval,
        ),
    )
}


def get_scorer(name: str, output_type: OutputType) -> Scorer:
    scorer = SCORERS.get(name)
    if scorer is None:
        raise errors.ValidationError(
            "task.scorer.name", f"unknown scorer {name!r}; known: {', '.join(sorted(SCORERS))}"
        )
    wanted = "generate_until" if scorer.output_type == "code_exec" else scorer.output_type
    if output_type not in (scorer.output_type, wanted):
        raise errors.ValidationError(
            "task.output_type",
            f"scorer {name!r} needs output_type {scorer.output_type!r}, not {output_type!r}",
        )
    return scorer


def corpus_perplexity(responses: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Corpus-level perplexities from summed log-likelihoods (not a mean of per-document ratios)."""
    nll = -sum(float(r["logprob"]) for r in responses)
    n_bytes = sum(int(r["bytes"]) for r in responses)
    n_tokens = sum(int(r["tokens"]) for r in responses)
    n_words = sum(int(r.get("words", 0)) for r in responses)
    out = {
        "byte_perplexity": math.exp(nll / max(1, n_bytes)),
        "token_perplexity": math.exp(nll / max(1, n_tokens)),
    }
    if n_words:
        out["word_perplexity"] = math.exp(nll / n_words)
    return out
