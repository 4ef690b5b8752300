"""The ``pretrain`` task: a Llama causal LM from scratch."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from forge_training.data import EOT, StepSampler, prepare
from forge_training.export import export_hf
from forge_training.mfu import train_flops_per_token
from forge_training.objectives.base import Micro, Objective, ObjectiveSpec, prepare_rank0_first
from forge_training.objectives.lm import evaluate_lm, lm_batch, lm_loss_sum
from forge_training.schema import TrainConfig


def model_config(config: TrainConfig, vocab_size: int, bos_eos: int) -> LlamaConfig:
    """The ``LlamaConfig`` of a model pre-trained from scratch."""
    m = config.model
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        max_position_embeddings=config.data.seq_len,
        rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
        bos_token_id=bos_eos,
        eos_token_id=bos_eos,
        pad_token_id=bos_eos,
        tie_word_embeddings=False,
    )


class Pretraining(Objective):
    """Causal LM from scratch on ``data.corpus`` with its own byte-level BPE."""

    task = "pretrain"

    def __init__(self, config: TrainConfig, rank: int, world_size: int, cache_dir: Path) -> None:
        super().__init__(config, rank, world_size)
        prepared = prepare_rank0_first(world_size, rank, lambda: prepare(config.data, cache_dir))
        self.train_split, self.val_split = prepared.split("train"), prepared.split("val")
        tok = prepared.tokenizer()
        eot = tok.token_to_id(EOT)
        if eot is None:
            raise RuntimeError(f"the tokenizer in {prepared.root} has no {EOT} token")
        self.tokenizer_json = tok.to_str()
        self.data_hash = prepared.data_hash
        self.chars_per_token = self.val_split.chars_per_token
        self.model = LlamaForCausalLM(model_config(config, tok.get_vocab_size(), eot))
        self.model.train()
        seq_len = config.data.seq_len
        self.sampler = StepSampler(
            self.train_split.num_windows(seq_len), config.global_batch_size, config.seed
        )
        self._flops_per_token = train_flops_per_token(
            self.model.config, self.model.config.vocab_size, seq_len
        )

    def collate(self, items: Sequence[Any]) -> Micro:
        return lm_batch(self.train_split, items, self.config.data.seq_len)

    def units(self, micro: Micro) -> float:
        return float(micro["labels"].numel())

    def flops(self, micro: Micro) -> float:
        return float(micro["labels"].numel()) * self._flops_per_token

    def loss(self, module: torch.nn.Module, micro: Micro) -> tuple[torch.Tensor, list[float]]:
        return lm_loss_sum(module, micro), []

    def evaluate(self) -> dict[str, float]:
        val = evaluate_lm(self.model, self.val_split, self.config, self.rank, self.world_size)
        return {"val_loss": val, "val_ppl": math.exp(min(val, 50.0))}

    def export(self, out_dir: Path, model: PreTrainedModel | None = None) -> Path:
        return export_hf(model or self.model, Tokenizer.from_str(self.tokenizer_json), out_dir)


def build(config: TrainConfig, rank: int, world_size: int, cache_dir: Path) -> Objective:
    return Pretraining(config, rank, world_size, cache_dir)


SPEC = ObjectiveSpec("pretrain", build, "causal LM from scratch with its own byte-level BPE")
