"""What every objective shares: the :class:`Objective` interface the loop drives, a step's batch,
the registry entry (:class:`ObjectiveSpec`), and the helpers for fixed evaluation sets that every
rank walks in step.

Loss convention: :meth:`Objective.loss` returns the *sum* over its micro-batch's loss units
(target tokens for language modelling, pairs for reward and DPO, groups for reranking) and figure
sums over the same units; the loop divides by the step's global number of units, so a step's
gradient is the same mean for any world size and micro-batch split.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from transformers import LlamaForCausalLM, PreTrainedModel

from forge_training.collectives import barrier
from forge_training.data import PreparedData
from forge_training.parents import Parent
from forge_training.schema import TrainConfig

Micro = dict[str, torch.Tensor]


class Sampler(Protocol):
    """A resumable source of each step's items (see :mod:`data`)."""

    def next_step(self, rank: int, world_size: int) -> Sequence[Any]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class StepBatch:
    """One rank's share of one optimizer step, made ahead by the prefetch thread."""

    micro: list[Micro]
    units: float
    """Loss units (target tokens or pairs) on this rank in this step."""
    tokens: float
    """Real (non-padding) tokens the trained model reads."""
    flops: float
    """Model FLOPs of the step on this rank (see :mod:`mfu`)."""
    position: dict[str, Any]
    """The sampler's state right after drawing this step: the resume point once it is trained."""


class Objective(ABC):
    """The task-specific half of a run. Made by :func:`build_objective`; used by :func:`train.train`."""

    task: str
    model: PreTrainedModel
    """The module being trained (the loop wraps it in DDP)."""
    sampler: Sampler
    tokenizer_json: str
    data_hash: str
    figure_names: tuple[str, ...] = ()
    """Per-unit figures :meth:`loss` reports beside the loss, in this order."""
    chars_per_token: float | None = None
    """Of the validation text, for a per-character loss (language-model tasks)."""

    def __init__(self, config: TrainConfig, rank: int, world_size: int) -> None:
        self.config = config
        self.rank, self.world_size = rank, world_size

    def draw(self) -> StepBatch:
        """Advance the sampler by one step and build this rank's micro-batches."""
        items = list(self.sampler.next_step(self.rank, self.world_size))
        position = self.sampler.state_dict()
        mb = self.config.micro_batch_size
        micro = [self.collate(items[i : i + mb]) for i in range(0, len(items), mb)]
        units = sum(self.units(m) for m in micro)
        tokens = sum(float(m["attention_mask"].sum()) for m in micro)
        flops = sum(self.flops(m) for m in micro)
        return StepBatch(micro, units, tokens, flops, position)

    @abstractmethod
    def collate(self, items: Sequence[Any]) -> Micro:
        """Tensors of one micro-batch (with an ``attention_mask``); runs in the prefetch thread."""

    @abstractmethod
    def units(self, micro: Micro) -> float: ...

    @abstractmethod
    def flops(self, micro: Micro) -> float: ...

    @abstractmethod
    def loss(self, module: torch.nn.Module, micro: Micro) -> tuple[torch.Tensor, list[float]]:
        """Summed loss over the micro-batch's units, and the sums of :attr:`figure_names`."""

    @abstractmethod
    def evaluate(self) -> dict[str, float]:
        """Held-out metrics (every rank calls it; ``val_loss`` is the primary one)."""

    @abstractmethod
    def export(self, out_dir: Path, model: PreTrainedModel | None = None) -> Path:
        """Write ``model`` (default: the trained one; under FSDP the loop passes a gathered,
        unsharded copy) and the tokenizer to ``out_dir`` in Hugging Face format."""

    def start(self) -> dict[str, float]:
        """Metrics of the starting model, measured once before the first step of a fresh run."""
        return {}

    def early_stop(self, step: int) -> str:
        """After step ``step``: why training should stop now (empty: go on). See DPO's monitor."""
        return ""

    def state_dict(self) -> dict[str, Any]:
        """Task state that a resume needs beyond model, optimizer and sampler."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None

    def to(self, device: torch.device) -> None:
        """Move the trained model (and any other model the task runs, as DPO's reference) to
        ``device``; the loop calls it once, after sharding."""
        module: torch.nn.Module = self.model
        module.to(device)

    def model_meta(self) -> dict[str, Any]:
        return {"task": self.task, "model_config": self.model.config.to_dict()}

    def head_prefixes(self) -> tuple[str, ...]:
        """Parameter-name prefixes of a freshly initialised head, which learns
        ``optim.head_lr_scale`` times faster than the rest (none by default)."""
        return ()


@dataclass(frozen=True)
class ObjectiveSpec:
    """A registry entry (as torchtitan's ``TrainSpec``): the task's name and the builder that makes
    its :class:`Objective` on each rank after the seeds are set (data prepared, model built or
    loaded)."""

    task: str
    build: Callable[[TrainConfig, int, int, Path], Objective]
    """``build(config, rank, world_size, cache_dir)``."""
    summary: str


def wins(margin: torch.Tensor) -> float:
    """Pairs ranked right: a positive margin counts one, a tie (as every pair at DPO's step 0)
    one half."""
    return float((margin > 0).sum()) + 0.5 * float((margin == 0).sum())


def spread(n: int, count: int) -> list[int]:
    """``count`` indices evenly spread over ``range(n)`` (a fixed evaluation set)."""
    return [int(i) for i in np.linspace(0, n - 1, min(count, n)).astype(np.int64)]


def rank_batches(items: Sequence[int], rank: int, world_size: int, size: int) -> list[tuple[list[int], bool]]:
    """This rank's share ``items[rank::world_size]`` in batches of ``size``, each with whether it
    counts. Ranks with fewer batches than rank 0 get repeats of ``items[0]`` that do not count:
    under FSDP every forward all-gathers parameters, so every rank must run the same number of
    forwards or the collectives hang."""
    mine = list(items[rank::world_size])
    batches = [(mine[i : i + size], True) for i in range(0, len(mine), size)]
    most = math.ceil(len(items[0::world_size]) / size)
    return batches + [([items[0]], False)] * (most - len(batches))


def prepare_rank0_first(world_size: int, rank: int, make: Callable[[], PreparedData]) -> PreparedData:
    if rank == 0:
        prepared = make()
    barrier(world_size)
    if rank != 0:
        prepared = make()
    return prepared


def adopt(parent: Parent, seq_len: int) -> LlamaForCausalLM:
    """The parent's model, train mode, with room for ``seq_len`` positions in its config."""
    model = parent.model
    model.config.max_position_embeddings = max(model.config.max_position_embeddings, seq_len)
    model.train()
    return model
