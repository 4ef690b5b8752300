"""Prompt/response tasks (SFT, reward models, DPO): the parent, its tokenizer and HH-RLHF pairs
split by seed; padded rows with the prompt masked; and the one held-out evaluation of the
pairwise objectives.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers import PreTrainedModel

from forge_training import pairs as pairdata
from forge_training.accuracy import PairwiseTally
from forge_training.collectives import all_reduce
from forge_training.data import EOT, StepSampler
from forge_training.device import on_model_device
from forge_training.export import export_hf
from forge_training.objectives.base import Micro, Objective, rank_batches, spread, wins
from forge_training.parents import Parent, load_parent
from forge_training.schema import TrainConfig


def pad_rows(rows: Sequence[pairdata.Encoded], pad_id: int, mask_prompt: bool) -> Micro:
    """Right-padded ``input_ids`` and ``attention_mask``; ``labels`` = ids on the response, -100
    on the prompt and the padding."""
    width = max(len(r.ids) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row.ids)
        ids[i, :n] = torch.tensor(row.ids)
        mask[i, :n] = 1
        start = row.prompt_len if mask_prompt else 0
        labels[i, start:n] = ids[i, start:n]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the sum of log-probabilities of the labelled (response) tokens, and their count.
    Position ``t``'s logits predict token ``t + 1``."""
    targets = labels[:, 1:]
    keep = targets != -100
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = torch.gather(logp, 2, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * keep).sum(-1), keep.sum(-1)


class PairTask(Objective):
    """Shared by SFT, reward and DPO: the parent, its tokenizer, HH-RLHF pairs split by seed."""

    end_of_text = True
    chosen_only = False

    def __init__(self, config: TrainConfig, rank: int, world_size: int) -> None:
        super().__init__(config, rank, world_size)
        parent = load_parent(config.init.parent)
        self.tokenizer_json = parent.tokenizer_json
        tok = parent.tokenizer()
        eot = tok.token_to_id(EOT)
        if eot is None:
            raise ValueError(f"init.parent: the tokenizer has no {EOT} token")
        self.pad_id = eot
        encode = dict(end_of_text=self.end_of_text, chosen_only=self.chosen_only)
        self._prepare_pairs(lambda pairs: pairdata.encode_pairs(tok, pairs, config.data.seq_len, **encode))
        self.model = self.make_model(parent)

    def _prepare_pairs(
        self, encode: Callable[[list[pairdata.PreferencePair]], Sequence[tuple[pairdata.Encoded, ...]]]
    ) -> None:
        """Split the pairs by seed, encode both splits, make the sampler over the training rows."""
        config = self.config
        train, val = pairdata.load_pairs(config.pairs, config.seed, config.data.val_fraction)
        self.train_pairs, self.val_pairs = train, val
        self.train_rows = list(encode(train))
        self.val_rows = list(encode(val))
        self.data_hash = pairdata.pairs_hash(config.pairs, config.seed, config.data.val_fraction)
        if len(self.train_rows) < config.global_batch_size:
            raise ValueError(
                f"pairs.path: {len(self.train_rows)} training pairs, fewer than one global batch "
                f"({config.global_batch_size})"
            )
        self.sampler = StepSampler(len(self.train_rows), config.global_batch_size, config.seed)

    @abstractmethod
    def make_model(self, parent: Parent) -> PreTrainedModel:
        """The trained model, made from the parent."""

    def start(self) -> dict[str, float]:
        """The held-out metrics of the starting model (the baseline the run improves on)."""
        return self.evaluate()

    def _eval_micro(self) -> list[tuple[Micro, bool]]:
        """This rank's held-out micro-batches, each with whether it counts (see :func:`rank_batches`)."""
        every = spread(len(self.val_rows), self.config.eval_batches * self.config.micro_batch_size)
        batches = rank_batches(every, self.rank, self.world_size, self.config.micro_batch_size)
        return [
            (on_model_device(self.collate(items, self.val_rows), self.model), counts)
            for items, counts in batches
        ]

    @abstractmethod
    def collate(
        self, items: Sequence[Any], rows: Sequence[tuple[pairdata.Encoded, ...]] | None = None
    ) -> Micro: ...

    def export(self, out_dir: Path, model: PreTrainedModel | None = None) -> Path:
        return export_hf(
            model or self.model, Tokenizer.from_str(self.tokenizer_json), out_dir, pairdata.CHAT_TEMPLATE
        )


class PreferenceTask(PairTask):
    """Reward models and DPO: micro-batches of [chosen..., rejected...] rows, loss units are pairs,
    and one held-out evaluation over the margins (:meth:`evaluate`)."""

    accuracy_name: str
    """The metric of pairs ranked right (with ``_low``/``_high``: its Wilson interval)."""
    margin_name: str
    """The metric of the mean margin."""

    def collate(
        self, items: Sequence[Any], rows: Sequence[tuple[pairdata.Encoded, ...]] | None = None
    ) -> Micro:
        source = self.train_rows if rows is None else rows
        chosen = [source[i][0] for i in items]
        rejected = [source[i][1] for i in items]
        return pad_rows(chosen + rejected, self.pad_id, mask_prompt=True)  # rows [chosen..., rejected...]

    def units(self, micro: Micro) -> float:
        return float(micro["input_ids"].size(0) // 2)

    @abstractmethod
    def margins(self, module: torch.nn.Module, micro: Micro) -> torch.Tensor:
        """Per pair: the margin of the chosen response over the rejected one that the loss
        pushes up (its Bradley-Terry loss is ``-log sigmoid(margin)``)."""

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out loss, pairs ranked right (a tie one half, :func:`wins`) with their Wilson
        interval, and the mean margin, summed over every rank (:class:`PairwiseTally`)."""
        self.model.eval()
        tally = PairwiseTally()
        for micro, counts in self._eval_micro():
            margin = self.margins(self.model, micro)
            if counts:
                tally.add(
                    float(-F.logsigmoid(margin).sum()), wins(margin), float(margin.sum()), margin.numel()
                )
        self.model.train()
        total = PairwiseTally.from_list(all_reduce(tally.as_list(), self.world_size))
        return total.figures(self.accuracy_name, self.margin_name)
