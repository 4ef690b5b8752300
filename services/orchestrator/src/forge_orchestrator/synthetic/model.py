"""The ``synthetic`` workflow's input, result and the check the API runs before starting it
(plain data: Temporal carries them)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from forge_experiments import recipecatalog
from forge_kit import errors
from forge_kit.modelref import ModelRef
from forge_orchestrator.identity import Caller

#: Outcomes of a run: trained (the whole pipeline), or an early end that says why.
OUTCOMES = ("trained", "no_problems", "nothing_verified", "empty_band")
POLICIES = ("majority", "drop")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
_TEMPLATE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 ._-]{0,127}$")


@dataclass
class SyntheticInput:
    """A synthetic-data run: teacher → verify → dedup/decontaminate → difficulty band → dataset →
    SFT of the student → held-out eval (see :mod:`forge_orchestrator.synthetic.workflow`)."""

    team: str
    work_uri: str
    """A folder the jobs' nodes and this orchestrator share; the run writes under
    ``<work_uri>/<workflow id>/``."""
    student_uri: str
    """The student's Hugging Face checkpoint folder: what SFT starts from and held-out eval scores."""
    student_model: str
    """The name the student endpoint serves the student under."""
    templates: list[str] = field(default_factory=list)
    """Seed templates (or topics) the teacher writes problems from."""
    heldout_templates: list[str] = field(default_factory=list)
    """Templates of the held-out problems the student is evaluated on (none of ``templates``)."""
    teacher_model: str = "forge-teacher"
    teacher_url: str = ""
    """OpenAI-compatible base URL (``…/v1``) of the teacher; empty: ``FORGE_SYNTHETIC_TEACHER_URL``."""
    student_url: str = ""
    """OpenAI-compatible base URL of the student; empty: ``FORGE_SYNTHETIC_STUDENT_URL`` (the gateway)."""
    problems: int = 64
    k: int = 4
    """Solutions the teacher writes per problem."""
    seed: int = 0
    policy: str = "majority"
    """When a problem's verified solutions disagree: ``majority`` keeps the majority answer, ``drop`` drops it."""
    dedup_threshold: float = 0.9
    """Jaccard similarity (MinHash, word 3-grams; numbers count) from which a question is a
    near-duplicate of an earlier one (template problems share most of their wording)."""
    decontaminate: bool = True
    """Drop problems near-duplicate to any eval benchmark's test split."""
    contamination_threshold: float = 0.5
    """Jaccard similarity from which a problem counts as a copy of a benchmark text."""
    samples: int = 8
    """Answers the student samples per problem for its pass rate."""
    band_low: float = 0.2
    band_high: float = 0.8
    """Problems whose pass rate lies in [band_low, band_high] are kept."""
    student_max_tokens: int = 96
    student_temperature: float = 1.0
    recipe: str = "sft_hh"
    """The SFT recipe (the training catalogue's); its data path and parent are set by the workflow."""
    sft_overrides: list[str] = field(default_factory=list)
    heldout_problems: int = 32
    python: str = "python"
    gpu_type: str = ""
    gpus: int = 1
    job_timeout_s: float = 3600.0
    checkpoint_wait_s: float = 120.0
    teacher_timeout_s: float = 60.0
    teacher_attempts: int = 4
    concurrency: int = 4
    caller: Caller | None = None
    """Who started it (set by the orchestrator from the caller's token); None: an admin."""


@dataclass
class SyntheticResult:
    outcome: str
    """One of :data:`OUTCOMES`."""
    message: str
    work_dir: str
    stages: dict[str, Any] = field(default_factory=dict)
    """Counts at every stage (teacher, verify, dedup, student, band, dataset)."""
    teacher: dict[str, Any] = field(default_factory=dict)
    histogram: dict[str, int] = field(default_factory=dict)
    """Problems per pass-rate bin (``"0.0-0.1"`` …), once the student has been sampled."""
    dataset: dict[str, Any] = field(default_factory=dict)
    """Where the dataset is, its content hash, tokens and lineage file."""
    checkpoint_uri: str = ""
    sft_job_id: str = ""
    heldout: dict[str, Any] = field(default_factory=dict)
    """The student before and after SFT on the held-out problems (accuracy, interval, paired delta)."""
    run_id: str = ""
    run_url: str = ""


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise errors.ValidationError(f"input.{name}", f"must be between {low:g} and {high:g}")


def validate_synthetic(params: SyntheticInput) -> None:
    """Refuse a bad input before anything runs; the error names the field."""
    if not params.team:
        raise errors.ValidationError("input.team", "must not be empty")
    for name in ("work_uri", "student_uri"):
        value = getattr(params, name)
        if not value or len(value) > 1024 or "\x00" in value or ".." in PurePosixPath(value).parts:
            raise errors.ValidationError(
                f"input.{name}", "must be a path or URL (no '..'), at most 1024 characters"
            )
    for name in ("student_model", "teacher_model"):
        if not _NAME.match(getattr(params, name)):
            raise errors.ValidationError(
                f"input.{name}", "must be 1-128 letters, digits, '.', '_', ':' or '-'"
            )
    try:
        ModelRef.parse(params.student_model)  # the gateway's grammar: the run may deploy it
    except ValueError as exc:
        raise errors.ValidationError("input.student_model", str(exc)) from None
    for name in ("teacher_url", "student_url"):
        url = getattr(params, name)
        if url and (
            not url.startswith(("http://", "https://")) or len(url) > 512 or any(c.isspace() for c in url)
        ):
            raise errors.ValidationError(f"input.{name}", "must be empty or an http(s) URL")
    for name in ("templates", "heldout_templates"):
        values = getattr(params, name)
        if not 1 <= len(values) <= 64:
            raise errors.ValidationError(f"input.{name}", "must name 1 to 64 templates")
        for i, value in enumerate(values):
            if not _TEMPLATE.match(value):
                raise errors.ValidationError(
                    f"input.{name}[{i}]", "must be 1-128 letters, digits, spaces, '.', '_' or '-'"
                )
    shared = sorted(set(params.templates) & set(params.heldout_templates))
    if shared:
        raise errors.ValidationError(
            "input.heldout_templates", f"must not share templates with input.templates: {shared}"
        )
    _check_range("problems", params.problems, 1, 100_000)
    _check_range("k", params.k, 1, 16)
    _check_range("seed", params.seed, 0, 1_000_000)
    if params.policy not in POLICIES:
        raise errors.ValidationError("input.policy", f"must be one of {', '.join(POLICIES)}")
    _check_range("dedup_threshold", params.dedup_threshold, 0.05, 1.0)
    _check_range("contamination_threshold", params.contamination_threshold, 0.05, 1.0)
    _check_range("samples", params.samples, 1, 16)
    if not 0.0 <= params.band_low <= params.band_high <= 1.0:
        raise errors.ValidationError("input.band_low", "need 0 <= band_low <= band_high <= 1")
    _check_range("student_max_tokens", params.student_max_tokens, 1, 4096)
    _check_range("student_temperature", params.student_temperature, 0.0, 2.0)
    if not _NAME.match(params.recipe):
        raise errors.ValidationError("input.recipe", "must be a recipe name")
    for i, pair in enumerate(params.sft_overrides):
        key = pair.partition("=")[0]
        if "=" not in pair or not key:
            raise errors.ValidationError(f"input.sft_overrides[{i}]", "must be KEY=VALUE")
        if key in ("init.parent", "pairs.path"):
            raise errors.ValidationError(f"input.sft_overrides[{i}]", f"{key} is set by the workflow")
    recipecatalog.check_overrides(params.recipe, params.sft_overrides, "input.sft_overrides", "input.recipe")
    _check_range("heldout_problems", params.heldout_problems, 1, 10_000)
    _check_range("gpus", params.gpus, 0, 64)
    _check_range("job_timeout_s", params.job_timeout_s, 1, 30 * 86400)
    _check_range("checkpoint_wait_s", params.checkpoint_wait_s, 0, 86400)
    _check_range("teacher_timeout_s", params.teacher_timeout_s, 0.1, 3600)
    _check_range("teacher_attempts", params.teacher_attempts, 1, 20)
    _check_range("concurrency", params.concurrency, 1, 64)
