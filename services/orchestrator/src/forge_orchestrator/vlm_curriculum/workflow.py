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

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from forge_orchestrator.routing import AUTO_EVAL_LABEL
    from forge_orchestrator.training.model import TrainInput, TrainResult
    from forge_orchestrator.training.workflow import TrainWorkflow
    from forge_orchestrator.vlm_curriculum.model import (
        StageRecord,
        VlmCurriculumInput,
        VlmCurriculumResult,
        job_name,
    )


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
