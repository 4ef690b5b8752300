"""The ``cpt`` workflow's input, result and checks (plain data: Temporal carries them).

The search space and the selection rule are :class:`forge_experiments.cptmix.SearchSpace` and
:class:`forge_experiments.cptmix.Rule`, the ones ``forge bench cpt`` uses.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from forge_experiments import cptmix, recipecatalog, sweepspace
from forge_kit import errors
from forge_orchestrator.identity import Caller

EARLY_STOPPING = ("asha", "median", "none")
TIERS = ("full", "smoke")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MAX_STEPS = 10_000_000
#: Keys the workflow sets itself on every run (an input override of one is refused).
OWN_KEYS = frozenset(
    {
        "init.parent",
        "data.corpus",
        "mixture.general_corpus",
        "mixture.general_fraction",
        "optim.lr",
        "optim.min_lr",
        "optim.warmup_steps",
        "optim.schedule",
        "max_steps",
        "seed",
    }
)


@dataclass
class CptInput:
    """A continual pre-training run: mixture search, final run, checkpoint choice, hand-over."""

    base: str
    """The base checkpoint: a Hugging Face folder (``config.json``, weights, ``tokenizer.json``)
    the nodes and the eval service can read; every run's ``init.parent``."""
    token_budget: int
    """Tokens of the final run (steps = budget / (global batch x sequence length))."""
    search: cptmix.SearchSpace
    """Replay fractions x peak LRs and the re-warm / re-decay schedule."""
    rule: cptmix.Rule = field(default_factory=cptmix.Rule)
    """How a checkpoint is chosen: forgetting limit, then the largest domain gain."""
    domain_corpus: str = "beir/scifact/corpus.jsonl"
    """``data.corpus`` of every run (a path inside the data folder, or absolute)."""
    general_corpus: str = "corpora/tinyshakespeare/input.txt"
    """``mixture.general_corpus``: the replay data, the base's own pre-training corpus."""
    domain_suite: str = "scifact_ppl"
    """Eval suite whose bits per byte define domain quality (the domain corpus's held-out tail)."""
    general_suite: str = "tinyshakespeare_ppl"
    """Eval suite whose bits per byte define general quality (forgetting is its rise)."""
    search_fraction: float = 0.25
    """Each search run's budget as a share of the final run's."""
    early_stopping: str = "asha"
    """Within each replay fraction's sweep over peak LRs: ``asha`` (stopping form, η = 3, first
    rung at a third of the search budget), ``median`` (from a third, at least 2 trials) or ``none``."""
    recipe: str = "cpt_scifact"
    overrides: dict[str, str] = field(default_factory=dict)
    """Fixed recipe overrides of every run (``eval_batches``, ``data.seq_len`` …), typed by the
    recipe catalogue; the keys the workflow sets itself are refused."""
    team: str = "research"
    python: str = "python"
    gpu_type: str = "SIM"
    gpus_per_trial: int = 1
    priority_class: str = "preemptible"
    concurrency: int = 2
    """Search runs in flight per replay fraction (the fractions' sweeps run side by side)."""
    gpu_hours: float = 10.0
    """GPU-hour budget of each fraction's sweep."""
    eval_limit: int = 50
    eval_tier: str = "full"
    eval_seed: int = 0
    eval_poll_s: float = 10.0
    """Seconds between polls of an eval run (each poll is a few history events)."""
    eval_timeout_s: float = 3600.0
    checkpoint_wait_s: float = 120.0
    """How long a finished run waits for its published checkpoint."""
    job_timeout_s: float = 6 * 3600.0
    model_name: str = "cpt"
    """Registry name of the base and the candidates (versions ``<workflow id>.<point>``)."""
    promote: bool = True
    """Hand the chosen checkpoint to ``eval_and_promote`` (on the domain suite)."""
    promote_tier: str = "smoke"
    report_dir: str = "var/reports/cpt"
    """Where ``<workflow id>/mixture.md``, ``mixture.png`` and ``summary.json`` are written (on
    the orchestrator's host; relative to its working directory unless absolute)."""
    caller: Caller | None = None
    """Who started it (set by the orchestrator from the caller's token)."""


@dataclass
class CptResult:
    outcome: str
    """``chosen`` (a checkpoint met the rule) or ``none_admissible`` (no search run did, so
    there was no final run; ``reason`` says by how much the best missed)."""
    reason: str
    mixture: dict[str, Any] = field(default_factory=dict)
    """The search's choice: ``general_fraction``, ``lr`` and why."""
    chosen: dict[str, Any] | None = None
    curve: list[dict[str, Any]] = field(default_factory=list)
    front: list[str] = field(default_factory=list)
    sweeps: list[str] = field(default_factory=list)
    """The child sweeps' workflow ids, one per replay fraction."""
    final_workflow_id: str = ""
    handover: dict[str, Any] = field(default_factory=dict)
    """The ``eval_and_promote`` child: ``workflow_id``, ``decision``, ``promoted_to``, reason."""
    report: dict[str, str] = field(default_factory=dict)
    """``markdown``, ``png``, ``json`` paths and the MLflow ``run_id`` / ``run_url``."""


def steps_for(params: CptInput, tokens: int) -> int:
    """Optimizer steps that train on ``tokens`` tokens with the recipe's batch and sequence."""
    keys = recipecatalog.recipe_keys(params.recipe, "input.recipe")
    over = typed_overrides(params)
    batch = int(over.get("global_batch_size", keys["global_batch_size"]["default"]))
    seq = int(over.get("data.seq_len", keys["data.seq_len"]["default"]))
    return max(1, math.ceil(tokens / (batch * seq)))


def budgets(params: CptInput) -> tuple[int, int]:
    """(search steps, final steps)."""
    final = steps_for(params, params.token_budget)
    return max(3, round(final * params.search_fraction)), final


def typed_overrides(params: CptInput) -> dict[str, Any]:
    """``overrides`` as the catalogue types them (``int``, ``float``, ``bool``, ``str``), parsed
    as the job parses them (:mod:`forge_experiments.recipecatalog`)."""
    recipecatalog.recipe_keys(params.recipe, "input.recipe")
    out: dict[str, Any] = {}
    for key, raw in params.overrides.items():
        path = f"input.overrides.{key[:80]}"
        kind = recipecatalog.check_key(params.recipe, key, path)
        if key in OWN_KEYS:
            raise errors.ValidationError(path, "is set by the workflow (base, corpora, search space, budget)")
        out[key] = recipecatalog.parse_value(kind, raw, path)
    return out


def fixed_overrides(params: CptInput) -> dict[str, Any]:
    """What every run sets besides its fraction, peak and budget."""
    return {
        **typed_overrides(params),
        "init.parent": params.base,
        "data.corpus": params.domain_corpus,
        "mixture.general_corpus": params.general_corpus,
    }


def space_of(params: CptInput, workflow_id: str, index: int, fraction: float, steps: int) -> dict[str, Any]:
    """The sweep space of replay fraction ``index`` (:func:`forge_experiments.cptmix.sweep_space`)."""
    min_steps = max(1, steps // 3)
    es: dict[str, Any] = {"rule": params.early_stopping}
    if params.early_stopping == "asha":
        es.update(min_steps=min_steps, eta=3, form="stopping")  # as forge bench cpt runs it
    elif params.early_stopping == "median":
        es.update(min_steps=min_steps, min_trials=2)
    fixed = fixed_overrides(params)
    if params.early_stopping != "none":
        fixed.setdefault("eval_interval", min_steps)
    return cptmix.sweep_space(
        params.search,
        fraction,
        name=f"{workflow_id}-f{index}"[:64],
        recipe=params.recipe,
        steps=steps,
        fixed=fixed,
        early_stopping=es,
        team=params.team,
        concurrency=params.concurrency,
        gpu_hours=params.gpu_hours,
        gpu_type=params.gpu_type,
        gpus_per_trial=params.gpus_per_trial,
        priority_class=params.priority_class,
    )


def _data_path(path: str, value: str) -> None:
    """A corpus: absolute, or inside the data folder (``forge_kit.paths.resolve_data_path``)."""
    if not value or len(value) > 1024 or "\x00" in value or ".." in value.split("/"):
        raise errors.ValidationError(path, "must be a path of 1-1024 characters without '..'")


def validate_cpt(params: CptInput) -> None:
    """Refuse a bad input before anything starts; the error names the field (``input.rule.bound``)."""
    if not params.base or len(params.base) > 1024 or "\x00" in params.base:
        raise errors.ValidationError("input.base", "must be the base checkpoint's folder (1-1024 characters)")
    _data_path("input.domain_corpus", params.domain_corpus)
    _data_path("input.general_corpus", params.general_corpus)
    params.search.validate("input.search")
    params.rule.validate("input.rule")
    if not 1 <= params.token_budget <= 10**13:
        raise errors.ValidationError("input.token_budget", "must be between 1 and 1e13 tokens")
    if not 0.01 <= params.search_fraction <= 1.0:
        raise errors.ValidationError("input.search_fraction", "must be between 0.01 and 1")
    if params.early_stopping not in EARLY_STOPPING:
        raise errors.ValidationError("input.early_stopping", f"must be one of {', '.join(EARLY_STOPPING)}")
    for name in ("domain_suite", "general_suite", "model_name", "team"):
        if not _NAME.match(getattr(params, name)):
            raise errors.ValidationError(f"input.{name}", "must be 1-64 letters, digits, '.', '_' or '-'")
    if params.domain_suite == params.general_suite:
        raise errors.ValidationError("input.general_suite", "must differ from input.domain_suite")
    for name in ("eval_tier", "promote_tier"):
        if getattr(params, name) not in TIERS:
            raise errors.ValidationError(f"input.{name}", f"must be one of {', '.join(TIERS)}")
    if not 0 <= params.eval_limit <= 100_000:
        raise errors.ValidationError("input.eval_limit", "must be between 0 and 100000")
    for name, low, high in (
        ("eval_poll_s", 0.1, 600.0),
        ("eval_timeout_s", 1.0, 7 * 86400.0),
        ("checkpoint_wait_s", 1.0, 86400.0),
        ("job_timeout_s", 1.0, 30 * 86400.0),
    ):
        if not low <= getattr(params, name) <= high:
            raise errors.ValidationError(f"input.{name}", f"must be between {low:g} and {high:g}")
    if not params.report_dir or ".." in params.report_dir.split("/") or "\x00" in params.report_dir:
        raise errors.ValidationError("input.report_dir", "must be a folder path without '..'")
    search_steps, final_steps = budgets(params)
    if final_steps > MAX_STEPS:
        raise errors.ValidationError("input.token_budget", f"is {final_steps} steps, more than {MAX_STEPS}")
    # Every fraction's sweep space, as the sweep workflow will read it (recipe keys, budgets,
    # team, device type, concurrency, history size).
    for i, fraction in enumerate(params.search.general_fractions):
        try:
            sweepspace.from_dict(space_of(params, "cpt-check", i, fraction, search_steps))
        except errors.ValidationError as exc:
            field_name = exc.field
            mapped = {"concurrency": "concurrency", "team": "team", "gpu_type": "gpu_type"}.get(field_name)
            where = f"input.{mapped}" if mapped else f"input.search (fraction {fraction:g}: {field_name})"
            raise errors.ValidationError(where, exc.message.split(": ", 1)[-1]) from None
