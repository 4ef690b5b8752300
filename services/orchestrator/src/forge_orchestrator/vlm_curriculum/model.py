"""The ``vlm_curriculum`` workflow's input and result, its stages' job names, and the API's check of
the input (plain data Temporal carries)."""

from __future__ import annotations

from dataclasses import dataclass, field

from forge_experiments import recipecatalog
from forge_kit import errors
from forge_orchestrator.identity import Caller

DEFAULT_STAGES = ["vlm_world_lm", "vlm_align", "vlm_interleave", "vlm_instruct"]


@dataclass
class VlmCurriculumInput:
    team: str
    stages: list[str] = field(default_factory=lambda: list(DEFAULT_STAGES))
    """Recipes in order; each after the first starts from the previous one's checkpoint."""
    parent: str = ""
    """``init.parent`` of the first stage (empty: the first stage needs none, as ``vlm_world_lm``)."""
    overrides: dict[str, list[str]] = field(default_factory=dict)
    """Per recipe, its ``key=value`` overrides (``init.parent`` is set here)."""
    gpus_per_replica: int = 1
    gpu_type: str = ""
    python: str = "python"
    stage_timeout_s: float = 6 * 3600.0
    checkpoint_wait_s: float = 120.0
    caller: Caller | None = None


@dataclass
class StageRecord:
    recipe: str
    job_id: str
    parent: str
    checkpoint_uri: str
    manifest_uri: str
    step: int
    metrics: dict[str, float]
    preemptions: int


@dataclass
class VlmCurriculumResult:
    stages: list[StageRecord]
    final_uri: str
    """The last stage's Hugging Face export."""


def job_name(index: int, recipe: str) -> str:
    """The scheduler's job name of stage ``index``: lowercase letters, digits and '-'."""
    cleaned = "".join(c if c.isalnum() else "-" for c in recipe.lower())
    return f"vlm-{index}-{cleaned}"[:63].rstrip("-")


def validate_vlm_curriculum(params: VlmCurriculumInput) -> None:
    if not params.team:
        raise errors.ValidationError("input.team", "must not be empty")
    if not 1 <= len(params.stages) <= 16:
        raise errors.ValidationError("input.stages", "must name 1 to 16 recipes")
    for i, recipe in enumerate(params.stages):
        if not recipe or len(recipe) > 128 or not all(c.isalnum() or c in "._-" for c in recipe):
            raise errors.ValidationError(
                f"input.stages[{i}]", "must be 1-128 letters, digits, '.', '_' or '-'"
            )
        recipecatalog.recipe_keys(recipe, f"input.stages[{i}]")
    for recipe, pairs in params.overrides.items():
        if recipe not in params.stages:
            raise errors.ValidationError(f"input.overrides.{recipe}", "is not one of input.stages")
        for i, pair in enumerate(pairs):
            if "=" not in pair or pair.startswith("="):
                raise errors.ValidationError(f"input.overrides.{recipe}[{i}]", "must be KEY=VALUE")
            if pair.startswith("init.parent="):
                raise errors.ValidationError(
                    f"input.overrides.{recipe}[{i}]",
                    "init.parent is set by the curriculum (use input.parent)",
                )
        recipecatalog.check_overrides(recipe, pairs, f"input.overrides.{recipe}", "input.stages")
    if not 1 <= params.gpus_per_replica <= 64:
        raise errors.ValidationError("input.gpus_per_replica", "must be between 1 and 64")
    if not params.gpu_type:
        raise errors.ValidationError("input.gpu_type", "must name the GPU type of the stages' jobs")
    if not 1 <= params.stage_timeout_s <= 30 * 86400:
        raise errors.ValidationError("input.stage_timeout_s", "must be between 1 and 2592000")
