"""The VLM curriculum workflow: ``vlm_curriculum`` (:class:`VlmCurriculumWorkflow`) chains training
runs, each stage's ``init.parent`` the previous stage's published checkpoint.

Stages default to ``vlm_world_lm`` (the language model, pre-trained on the synthetic world's text;
its corpus must exist on the nodes: ``python -m forge_training.vlm.dataset
$FORGE_DATA_DIR/vlm/world-0``), ``vlm_align``, ``vlm_interleave`` and ``vlm_instruct``
(``forge_training.recipes``). Each stage is one ``training`` child workflow
(:class:`~forge_orchestrator.training.workflow.TrainWorkflow`): its job is checkpointable and resumes
from its last checkpoint after a preemption, its metrics and checkpoints are tracked as any text
run's. The parent handed on is the checkpoint's manifest (object-store URL, checked against its
sha256 by the next stage), else its export. ``parent`` starts the chain from an existing
checkpoint instead of training the first stage's own parent (e.g. an already pre-trained LM,
skipping ``vlm_world_lm``). Child ids are ``<id>-<index>-<recipe>``: a restarted curriculum's
history replays finished stages rather than training them again. Only the last stage's
checkpoint gets the automatic eval-and-promote.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from forge_experiments import recipecatalog
    from forge_kit import errors
    from forge_orchestrator.identity import Caller
    from forge_orchestrator.routing import AUTO_EVAL_LABEL
    from forge_orchestrator.training.model import TrainInput, TrainResult
    from forge_orchestrator.training.workflow import TrainWorkflow

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


@workflow.defn(name="vlm_curriculum")
class VlmCurriculumWorkflow:
    def __init__(self) -> None:
        self._stage = ""
        self._done: list[str] = []

    @workflow.query(name="progress")
    def progress(self) -> dict[str, object]:
        return {"stage": self._stage, "done": list(self._done)}

    @workflow.run
    async def run(self, params: VlmCurriculumInput) -> VlmCurriculumResult:
        wid = workflow.info().workflow_id
        parent = params.parent
        records: list[StageRecord] = []
        last = len(params.stages) - 1
        for i, recipe in enumerate(params.stages):
            self._stage = recipe
            overrides = [*params.overrides.get(recipe, [])]
            if parent:
                overrides.append(f"init.parent={parent}")
            train = TrainInput(
                team=params.team,
                recipe=recipe,
                name=job_name(i, recipe),
                overrides=overrides,
                gpus_per_replica=params.gpus_per_replica,
                gpu_type=params.gpu_type,
                python=params.python,
                timeout_s=params.stage_timeout_s,
                checkpoint_wait_s=params.checkpoint_wait_s,
                labels={} if i == last else {AUTO_EVAL_LABEL: "false"},
                caller=params.caller,
                auto_eval=i == last,
            )
            result: TrainResult = await workflow.execute_child_workflow(
                TrainWorkflow.run,
                train,
                id=f"{wid}-{i}-{recipe}",
                retry_policy=RetryPolicy(maximum_attempts=1),
            )
            checkpoint = result.checkpoint
            assert checkpoint is not None  # the training workflow fails without one
            records.append(
                StageRecord(
                    recipe,
                    result.job_id,
                    parent,
                    checkpoint.uri,
                    checkpoint.manifest_uri,
                    checkpoint.step,
                    dict(checkpoint.metrics),
                    result.preemptions,
                )
            )
            parent = checkpoint.manifest_uri or checkpoint.uri
            self._done.append(recipe)
        self._stage = "done"
        return VlmCurriculumResult(records, records[-1].checkpoint_uri)
