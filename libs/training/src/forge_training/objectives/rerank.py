"""The ``rerank`` task's objective: a cross-encoder from a bundled encoder, listwise softmax over
each group of (query, one relevant passage, hard negatives); the data (BEIR datasets, BM25,
groups) is :mod:`forge_training.rerank`'s, whose docstring gives the steps."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, PreTrainedModel

from forge_kit.paths import resolve_data_path
from forge_kit.stats import wilson_interval
from forge_training.backbones import BACKBONE_NAMES, backbone_dir
from forge_training.collectives import all_reduce
from forge_training.data import StepSampler
from forge_training.device import on_model_device
from forge_training.mfu import train_flops_per_token
from forge_training.objectives.base import Micro, Objective, ObjectiveSpec, rank_batches, spread
from forge_training.objectives.encoder import encoder_classifier, encoder_head_prefixes, save_encoder
from forge_training.rerank import (
    Encoded,
    EpochTagged,
    Group,
    build_groups,
    read_dataset,
    rerank_data_hash,
    split_queries,
)
from forge_training.schema import TrainConfig


class CrossEncoderRanking(Objective):
    """Steps 1-7 of the module docstring. Loss units are groups."""

    task = "rerank"
    figure_names = ("rank_accuracy", "reciprocal_rank")

    def __init__(self, config: TrainConfig, rank: int, world_size: int) -> None:
        super().__init__(config, rank, world_size)
        r = config.rerank
        self.source = backbone_dir(config.init.backbone)
        self.tokenizer_json = (self.source / "tokenizer.json").read_text(encoding="utf-8")
        tokenizer = AutoTokenizer.from_pretrained(self.source)
        self.pad_id = int(tokenizer.pad_token_id)
        self.group_size = 1 + r.negatives
        rng = random.Random(config.seed)
        train: list[Group] = []
        val: list[Group] = []
        self.counts: dict[str, dict[str, int]] = {}
        for name in r.names():
            data = read_dataset(resolve_data_path(r.root), name)
            train_q, val_q = split_queries(data, config.seed, config.data.val_fraction)
            mine = build_groups(data, train_q, r, rng, r.groups_per_dataset)
            held = build_groups(data, val_q, r, rng, len(val_q))
            self.counts[name] = {"train_groups": len(mine), "heldout_groups": len(held)}
            train += mine
            val += held
        rng.shuffle(train)
        if len(train) < config.global_batch_size:
            raise ValueError(
                f"rerank.datasets: {len(train)} training groups, fewer than one global batch "
                f"({config.global_batch_size}); check the datasets and rerank.groups_per_dataset"
            )
        if not val:
            raise ValueError("data.val_fraction: no held-out group (too few judged queries)")
        self.train_groups = train
        self.val_rows = self._encode(tokenizer, [g.passages for g in val], [g.query for g in val])
        self._tokenizer = tokenizer  # training batches are encoded as drawn, in the prefetch thread
        self.data_hash = rerank_data_hash(config)
        self.sampler = EpochTagged(StepSampler(len(train), config.global_batch_size, config.seed))
        self.model = encoder_classifier(self.source, config.data.seq_len, self.pad_id, config.init)

    def _encode(
        self, tokenizer: Any, passages: Sequence[Sequence[str]], queries: Sequence[str]
    ) -> list[list[Encoded]]:
        """Step 5: every (query, passage) pair of each group, cut to ``data.seq_len``."""
        encoded = tokenizer(
            [q for q, group in zip(queries, passages, strict=True) for _ in group],
            [p for group in passages for p in group],
            truncation="only_second",
            max_length=self.config.data.seq_len,
        )
        pairs = list(zip(encoded["input_ids"], encoded["token_type_ids"], strict=True))
        n = self.group_size
        return [pairs[i * n : (i + 1) * n] for i in range(len(passages))]

    def passages(self, index: int, epoch: int) -> tuple[str, ...]:
        """Training group ``index``'s passages in ``epoch``: the negatives drawn at build time in
        the first epoch, drawn again from the group's pool in every later one (with
        ``rerank.resample_negatives``), from a generator seeded by (seed, epoch, index), so a
        resumed run sees the same groups."""
        group = self.train_groups[index]
        if epoch == 0 or not self.config.rerank.resample_negatives:
            return group.passages
        rng = random.Random(f"{self.config.seed}/{epoch}/{index}")
        return group.redraw(self.config.rerank.negatives, rng)

    def head_prefixes(self) -> tuple[str, ...]:
        return encoder_head_prefixes(self.model)

    def collate(self, items: Sequence[Any], rows: Sequence[list[Encoded]] | None = None) -> Micro:
        """Training items are (group index, epoch) from the sampler; held-out items index ``rows``."""
        if rows is None:
            groups = [self.passages(i, epoch) for i, epoch in items]
            queries = [self.train_groups[i].query for i, _ in items]
            pairs = [pair for group in self._encode(self._tokenizer, groups, queries) for pair in group]
        else:
            pairs = [pair for i in items for pair in rows[i]]
        width = max(len(ids) for ids, _ in pairs)
        ids = torch.full((len(pairs), width), self.pad_id, dtype=torch.long)
        types = torch.zeros((len(pairs), width), dtype=torch.long)
        mask = torch.zeros((len(pairs), width), dtype=torch.long)
        for row, (tokens, type_ids) in enumerate(pairs):
            ids[row, : len(tokens)] = torch.tensor(tokens)
            types[row, : len(tokens)] = torch.tensor(type_ids)
            mask[row, : len(tokens)] = 1
        return {"input_ids": ids, "token_type_ids": types, "attention_mask": mask}

    def units(self, micro: Micro) -> float:
        return float(micro["input_ids"].size(0) // self.group_size)

    def flops(self, micro: Micro) -> float:
        per_token = train_flops_per_token(self.model.config, 1, micro["input_ids"].size(1))
        return float(micro["attention_mask"].sum()) * per_token

    def scores(self, module: torch.nn.Module, micro: Micro) -> torch.Tensor:
        """(groups, group size) scores; the relevant passage is column 0."""
        logits = module(
            input_ids=micro["input_ids"],
            token_type_ids=micro["token_type_ids"],
            attention_mask=micro["attention_mask"],
        ).logits
        return logits.float().reshape(-1, self.group_size)

    @staticmethod
    def _figures(scores: torch.Tensor) -> list[float]:
        """Groups whose relevant passage ranks first (ties count against it), and the sum of its
        reciprocal ranks."""
        ahead = (scores[:, 1:] >= scores[:, :1]).sum(-1)
        return [float((ahead == 0).sum()), float((1.0 / (ahead + 1).float()).sum())]

    def loss(self, module: torch.nn.Module, micro: Micro) -> tuple[torch.Tensor, list[float]]:
        scores = self.scores(module, micro)
        target = torch.zeros(scores.size(0), dtype=torch.long, device=scores.device)
        return F.cross_entropy(scores, target, reduction="sum"), self._figures(scores.detach())

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        every = spread(len(self.val_rows), self.config.eval_batches * self.config.micro_batch_size)
        batches = rank_batches(every, self.rank, self.world_size, self.config.micro_batch_size)
        self.model.eval()
        sums = [0.0, 0.0, 0.0, 0.0]  # loss, first, reciprocal rank, groups
        for items, counts in batches:
            scores = self.scores(self.model, on_model_device(self.collate(items, self.val_rows), self.model))
            if not counts:
                continue
            target = torch.zeros(scores.size(0), dtype=torch.long, device=scores.device)
            first, reciprocal = self._figures(scores)
            sums = [
                sums[0] + float(F.cross_entropy(scores, target, reduction="sum")),
                sums[1] + first,
                sums[2] + reciprocal,
                sums[3] + scores.size(0),
            ]
        self.model.train()
        total, first, reciprocal, n = all_reduce(sums, self.world_size)
        low, high = wilson_interval(first, n)
        return {
            "val_loss": total / n,
            "val_rank_accuracy": first / n,
            "val_rank_accuracy_low": low,
            "val_rank_accuracy_high": high,
            "val_mrr": reciprocal / n,
            "chance_loss": math.log(self.group_size),
            "eval_groups": n,
        }

    def start(self) -> dict[str, float]:
        return self.evaluate()

    def model_meta(self) -> dict[str, Any]:
        return {
            **super().model_meta(),
            "backbone": BACKBONE_NAMES.get(self.config.init.backbone, ""),
            "groups": self.counts,
        }

    def export(self, out_dir: Path, model: PreTrainedModel | None = None) -> Path:
        return save_encoder(model or self.model, self.source, out_dir, self.config.data.seq_len)


def build(config: TrainConfig, rank: int, world_size: int, cache_dir: Path) -> Objective:
    return CrossEncoderRanking(config, rank, world_size)


SPEC = ObjectiveSpec("rerank", build, "the reranker's cross-encoder, listwise over BM25 hard negatives")
