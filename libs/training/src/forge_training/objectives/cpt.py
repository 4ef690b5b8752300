"""The ``cpt`` task: continual pre-training of the parent on a domain corpus with general replay."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import PreTrainedModel

from forge_training.data import MixtureSampler, PreparedData, prepare
from forge_training.export import export_hf
from forge_training.mfu import train_flops_per_token
from forge_training.objectives.base import Micro, Objective, ObjectiveSpec, adopt, prepare_rank0_first
from forge_training.objectives.lm import evaluate_lm, lm_loss_sum
from forge_training.parents import load_parent
from forge_training.schema import TrainConfig


class ContinualPretraining(Objective):
    """The parent's causal LM on ``data.corpus`` (domain) mixed with ``mixture.general_corpus``
    by sampling weight, both tokenised with the parent's tokenizer. Evaluation: domain
    ``val_loss`` next to ``general_val_loss`` and ``forgetting`` (its rise since the start)."""

    task = "cpt"
    figure_names = ("general_fraction",)
    DOMAIN, GENERAL = 0, 1

    def __init__(self, config: TrainConfig, rank: int, world_size: int, cache_dir: Path) -> None:
        super().__init__(config, rank, world_size)
        parent = load_parent(config.init.parent)
        self.tokenizer_json = parent.tokenizer_json
        general_cfg = replace(config.data, corpus=config.mixture.general_corpus)

        def both() -> PreparedData:
            prepare(general_cfg, cache_dir, self.tokenizer_json)
            return prepare(config.data, cache_dir, self.tokenizer_json)

        domain = prepare_rank0_first(world_size, rank, both)
        general = prepare(general_cfg, cache_dir, self.tokenizer_json)  # cached by now
        self.data_hash = f"{domain.data_hash}+{general.data_hash}"
        self.splits = {
            "train": (domain.split("train"), general.split("train")),
            "val": (domain.split("val"), general.split("val")),
        }
        self.chars_per_token = self.splits["val"][self.DOMAIN].chars_per_token
        seq_len = config.data.seq_len
        self.model = adopt(parent, seq_len)
        f = config.mixture.general_fraction
        sizes = [s.num_windows(seq_len) for s in self.splits["train"]]
        if min(sizes) < 1:
            raise ValueError(f"a mixture source has no training window of {seq_len} tokens: {sizes}")
        self.sampler = MixtureSampler(sizes, [1.0 - f, f], config.global_batch_size, config.seed)
        self._flops_per_token = train_flops_per_token(
            self.model.config, self.model.config.vocab_size, seq_len
        )
        self.general_val_loss_start: float | None = None

    def collate(self, items: Sequence[Any]) -> Micro:
        seq_len = self.config.data.seq_len
        rows = [self.splits["train"][source].window(w, seq_len) for source, w in items]
        data = torch.from_numpy(np.stack(rows))
        general = torch.tensor([float(source == self.GENERAL) for source, _ in items])
        x = data[:, :-1]
        return {
            "input_ids": x,
            "labels": data[:, 1:],
            "attention_mask": torch.ones_like(x),
            "general": general,
        }

    def units(self, micro: Micro) -> float:
        return float(micro["labels"].numel())

    def flops(self, micro: Micro) -> float:
        return float(micro["labels"].numel()) * self._flops_per_token

    def loss(self, module: torch.nn.Module, micro: Micro) -> tuple[torch.Tensor, list[float]]:
        general_tokens = float(micro["general"].sum()) * micro["labels"].size(1)
        return lm_loss_sum(module, micro), [general_tokens]

    def _general_val(self) -> float:
        return evaluate_lm(
            self.model, self.splits["val"][self.GENERAL], self.config, self.rank, self.world_size
        )

    def start(self) -> dict[str, float]:
        metrics = self.evaluate()
        self.general_val_loss_start = metrics["general_val_loss"]
        return metrics

    def evaluate(self) -> dict[str, float]:
        val = evaluate_lm(
            self.model, self.splits["val"][self.DOMAIN], self.config, self.rank, self.world_size
        )
        general = self._general_val()
        out = {
            "val_loss": val,
            "val_ppl": math.exp(min(val, 50.0)),
            "general_val_loss": general,
            "general_val_ppl": math.exp(min(general, 50.0)),
        }
        if self.general_val_loss_start is not None:
            out["forgetting"] = general - self.general_val_loss_start
        return out

    def state_dict(self) -> dict[str, Any]:
        return (
            {}
            if self.general_val_loss_start is None
            else {"general_val_loss_start": self.general_val_loss_start}
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "general_val_loss_start" in state:
            self.general_val_loss_start = float(state["general_val_loss_start"])

    def export(self, out_dir: Path, model: PreTrainedModel | None = None) -> Path:
        return export_hf(model or self.model, Tokenizer.from_str(self.tokenizer_json), out_dir)


def build(config: TrainConfig, rank: int, world_size: int, cache_dir: Path) -> Objective:
    return ContinualPretraining(config, rank, world_size, cache_dir)


SPEC = ObjectiveSpec("cpt", build, "the parent's causal LM on a domain corpus mixed with general replay")
