"""Language modelling shared by pre-training and continual pre-training: windows of token
shards as batches, the summed next-token loss, and the held-out loss over a fixed set of windows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from forge_training.collectives import all_reduce
from forge_training.data import TokenShards
from forge_training.device import on_model_device
from forge_training.objectives.base import Micro, rank_batches, spread
from forge_training.schema import TrainConfig


def lm_batch(split: TokenShards, windows: Sequence[int], seq_len: int) -> Micro:
    rows = torch.from_numpy(np.stack([split.window(i, seq_len) for i in windows]))
    x, y = rows[:, :-1], rows[:, 1:]
    return {"input_ids": x, "labels": y, "attention_mask": torch.ones_like(x)}


def lm_loss_sum(module: torch.nn.Module, micro: Micro) -> torch.Tensor:
    logits = module(input_ids=micro["input_ids"], use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), micro["labels"].reshape(-1), reduction="sum")


@torch.no_grad()
def evaluate_lm(
    model: torch.nn.Module, split: TokenShards, config: TrainConfig, rank: int, world_size: int
) -> float:
    """Mean per-token loss on a fixed, evenly spread set of ``split``'s windows (split by rank)."""
    seq_len = config.data.seq_len
    windows = spread(split.num_windows(seq_len), config.eval_batches * config.micro_batch_size)
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0.0
    for batch, counts in rank_batches(windows, rank, world_size, config.micro_batch_size):
        micro = on_model_device(lm_batch(split, batch, seq_len), model)
        loss = float(lm_loss_sum(model, micro))
        if counts:
            total += loss
            tokens += micro["labels"].numel()
    model.train(was_training)
    total, tokens = all_reduce([total, tokens], world_size)
    return total / tokens
