"""Training objectives: what each task trains, on which data, with which loss and evaluation.

The loop in :mod:`forge_training.train` is the same for every task; an
:class:`~forge_training.objectives.base.Objective` supplies what differs. Each task is one module
here with a ``SPEC`` (:class:`~forge_training.objectives.base.ObjectiveSpec`: the task's name and
the builder of its objective), collected in :data:`OBJECTIVES` as torchtitan's ``TrainSpec``
registry is; :func:`build_objective` makes the run's on every rank after the seeds are set. The
loop then calls ``draw`` (in the prefetch thread), ``loss`` for each micro-batch, ``evaluate`` on
the eval interval and ``export`` at the end.

| module | task |
|---|---|
| :mod:`.pretrain` | ``pretrain`` |
| :mod:`.cpt` | ``cpt`` |
| :mod:`.sft` | ``sft`` |
| :mod:`.reward`, :mod:`.lengthdebias` | ``reward`` (on the parent's backbone or a bundled encoder; the registry entry and the length debiasing are :mod:`.lengthdebias`'s) |
| :mod:`.dpo` | ``dpo`` |
| :mod:`.rerank` | ``rerank`` |
| :mod:`.vlm` | ``vlm`` (a vision-language curriculum stage; data and model in :mod:`forge_training.vlm`) |

Shared parts: :mod:`.base` (the interface, evaluation sets), :mod:`.lm` (language modelling),
:mod:`.pairwise` (prompt/response tasks and the one pairwise evaluation), :mod:`.encoder`
(bundled encoders under a new head).
"""

from __future__ import annotations

from pathlib import Path

from forge_training.objectives import cpt, dpo, lengthdebias, pretrain, rerank, sft, vlm
from forge_training.objectives.base import Objective, ObjectiveSpec, StepBatch
from forge_training.schema import TrainConfig

OBJECTIVES: dict[str, ObjectiveSpec] = {
    spec.task: spec
    for spec in (pretrain.SPEC, cpt.SPEC, sft.SPEC, lengthdebias.SPEC, dpo.SPEC, rerank.SPEC, vlm.SPEC)
}
"""Every task's registry entry, by task name."""

__all__ = ["OBJECTIVES", "Objective", "ObjectiveSpec", "StepBatch", "build_objective"]


def build_objective(config: TrainConfig, rank: int, world_size: int, cache_dir: Path) -> Objective:
    """The :class:`Objective` of ``config.task`` (data prepared, model built or loaded)."""
    spec = OBJECTIVES.get(config.task)
    if spec is None:
        raise ValueError(f"task: unknown task {config.task!r}")
    return spec.build(config, rank, world_size, cache_dir)
