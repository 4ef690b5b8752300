"""The ``sft`` task: supervised fine-tuning on chosen conversations."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from forge_training import pairs as pairdata
from forge_training.collectives import all_reduce
from forge_training.mfu import train_flops_per_token
from forge_training.objectives.base import Micro, Objective, ObjectiveSpec, adopt
from forge_training.objectives.pairwise import PairTask, pad_rows
from forge_training.parents import Parent
from forge_training.schema import TrainConfig


class SupervisedFineTuning(PairTask):
    """The parent's causal LM on chosen conversations; loss on the final response tokens only."""

    task = "sft"
    chosen_only = True

    def make_model(self, parent: Parent) -> PreTrainedModel:
        return adopt(parent, self.config.data.seq_len)

    def collate(
        self, items: Sequence[Any], rows: Sequence[tuple[pairdata.Encoded, ...]] | None = None
    ) -> Micro:
        source = self.train_rows if rows is None else rows
        return pad_rows([source[i][0] for i in items], self.pad_id, mask_prompt=True)

    def units(self, micro: Micro) -> float:
        return float((micro["labels"][:, 1:] != -100).sum())

    def flops(self, micro: Micro) -> float:
        per_token = train_flops_per_token(
            self.model.config, self.model.config.vocab_size, micro["input_ids"].size(1)
        )
        return float(micro["attention_mask"].sum()) * per_token

    def loss(self, module: torch.nn.Module, micro: Micro) -> tuple[torch.Tensor, list[float]]:
        logits = module(
            input_ids=micro["input_ids"], attention_mask=micro["attention_mask"], use_cache=False
        ).logits
        targets = micro["labels"][:, 1:]
        return F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)),
            targets.reshape(-1),
            ignore_index=-100,
            reduction="sum",
        ), []

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.model.eval()
        total, units = 0.0, 0.0
        for micro, counts in self._eval_micro():
            loss, _ = self.loss(self.model, micro)
            if counts:
                total, units = total + float(loss), units + self.units(micro)
        self.model.train()
        total, units = all_reduce([total, units], self.world_size)
        val = total / max(units, 1.0)
        return {"val_loss": val, "val_ppl": math.exp(min(val, 50.0))}


def build(config: TrainConfig, rank: int, world_size: int, cache_dir: Path) -> Objective:
    return SupervisedFineTuning(config, rank, world_size)


SPEC = ObjectiveSpec("sft", build, "the parent's causal LM on chosen conversations, loss on the response")
