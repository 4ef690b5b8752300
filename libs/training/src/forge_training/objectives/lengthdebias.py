"""Reward models that judge quality rather than length: length-balanced pairs and ODIN's head.

A Bradley-Terry reward model trained on pairs whose chosen reply is usually the longer one (59 %
of helpful-base's) learns length as a shortcut. Two remedies, recipe options of the ``reward``
task on a bundled encoder, usable together:

- ``pairs.length_balance``: ``reweight`` weighs each training pair so that the pairs whose chosen
  reply is the longer one and those whose chosen reply is the shorter one carry half of the loss
  each (tied pairs weigh 1; the mean weight of the untied ones stays 1); ``subsample`` keeps every
  pair of the smaller group and a seeded sample of the larger one of the same size.
- ``reward.length_head`` (ODIN, Chen et al. 2024): the head scores each sequence twice from the
  same pooled output, a quality score ``q`` and a length score ``l``; the Bradley-Terry loss reads
  their sum, ``reward.length_corr_weight`` x ``(|corr(q, L)| - corr(l, L))`` over the micro-batch's
  sequences (``L`` the reply's length in words) pushes length into ``l`` and out of ``q``, and
  ``reward.length_ortho_weight`` x ``|w_q . w_l|`` keeps the two weight vectors orthogonal. Held-out
  accuracy and the export read ``q`` alone: the exported checkpoint is an ordinary one-label
  ``BertForSequenceClassification`` whose score is the quality head.

Lengths and groups are :mod:`forge_experiments.rmlength`'s (words), as ``forge rm eval`` reports them.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from forge_experiments import rmlength
from forge_training import pairs as pairdata
from forge_training.collectives import all_reduce
from forge_training.data import StepSampler
from forge_training.objectives.base import Micro, Objective, ObjectiveSpec, wins
from forge_training.objectives.encoder import encoder_classifier
from forge_training.objectives.reward import EncoderRewardModeling, RewardModeling
from forge_training.schema import TrainConfig

QUALITY, LENGTH = 0, 1
"""Rows of the two-output classifier of an ODIN model."""


def strata(pairs: Sequence[pairdata.PreferencePair]) -> list[str]:
    """Each pair's group: ``preferred_longer``, ``preferred_shorter`` or ``tie`` (words)."""
    return [rmlength.stratum(p.chosen, p.rejected) for p in pairs]


def balance_weights(groups: Sequence[str]) -> list[float]:
    """Loss weights giving the preferred-longer and the preferred-shorter pairs half of the
    untied pairs' total weight each; tied pairs, and every pair when a group is empty, weigh 1."""
    longer = sum(1 for g in groups if g == "preferred_longer")
    shorter = sum(1 for g in groups if g == "preferred_shorter")
    if not longer or not shorter:
        return [1.0] * len(groups)
    untied = longer + shorter
    weight = {"preferred_longer": untied / (2 * longer), "preferred_shorter": untied / (2 * shorter)}
    return [weight.get(g, 1.0) for g in groups]


def balance_subsample(groups: Sequence[str], seed: int) -> list[int]:
    """Indices kept: every tied pair and every pair of the smaller of the preferred-longer and
    preferred-shorter groups, and as many of the larger group, drawn by ``seed``; in order."""
    members = {
        g: [i for i, x in enumerate(groups) if x == g] for g in ("preferred_longer", "preferred_shorter")
    }
    size = min(len(v) for v in members.values())
    rng = np.random.default_rng([seed, 0x1E46])
    keep = [i for i, g in enumerate(groups) if g == "tie"]
    for indices in members.values():
        keep += [indices[int(j)] for j in sorted(rng.choice(len(indices), size=size, replace=False))]
    return sorted(keep)


#: Floor on a score's standard deviation in :func:`pearson`: a fresh head's scores spread by
#: about 0.01, where the correlation's gradient (about 1 / spread) would swamp the ranking loss.
MIN_SCORE_STD = 0.5


def pearson(x: torch.Tensor, y: torch.Tensor, min_std: float = MIN_SCORE_STD) -> torch.Tensor:
    """Pearson correlation of the scores ``x`` with the lengths ``y`` (1-D), ``x``'s standard
    deviation floored at ``min_std`` (below it, a covariance scaled by a constant); 0 when ``y``
    is constant."""
    xc, yc = x - x.mean(), y - y.mean()
    n = x.numel() ** 0.5
    return (xc * yc).sum() / (xc.norm().clamp_min(min_std * n) * yc.norm().clamp_min(1e-6))


def odin_penalty(
    quality: torch.Tensor,
    length_score: torch.Tensor,
    lengths: torch.Tensor,
    heads: torch.Tensor,
    corr_weight: float,
    ortho_weight: float,
) -> tuple[torch.Tensor, float, float]:
    """ODIN's disentangling terms for one micro-batch's sequences: ``corr_weight`` x
    ``(|corr(q, L)| - corr(l, L))`` + ``ortho_weight`` x ``|w_q . w_l|`` (``heads``: the
    classifier's weight, one row per head). Also the two correlations (figures)."""
    length = lengths.to(quality.dtype)
    rho_q, rho_l = pearson(quality, length), pearson(length_score, length)
    ortho = (heads[QUALITY] * heads[LENGTH]).sum().abs()
    penalty = corr_weight * (rho_q.abs() - rho_l) + ortho_weight * ortho
    return penalty, float(rho_q.detach()), float(rho_l.detach())


def debiased_loss(
    scores: torch.Tensor,
    weight: torch.Tensor,
    lengths: torch.Tensor,
    heads: torch.Tensor | None,
    corr_weight: float = 1.0,
    ortho_weight: float = 1.0,
) -> tuple[torch.Tensor, list[float]]:
    """The summed loss of a micro-batch and its figure sums (accuracy, margin, the two length
    correlations). ``scores``: one row per sequence, chosen rows then rejected rows, one column
    (a plain reward) or two (ODIN's quality and length, ``heads`` their weight rows); ``weight``:
    per pair; ``lengths``: per sequence. The Bradley-Terry margin reads the sum of the columns;
    under ODIN :func:`odin_penalty` is added once per pair (the loop divides by pairs)."""
    reward = scores.sum(-1)
    chosen, rejected = reward.chunk(2)
    margin = chosen - rejected
    loss = -(weight.to(scores.device) * F.logsigmoid(margin)).sum()
    pairs = margin.numel()
    rho_q = rho_l = 0.0
    if heads is not None:
        penalty, rho_q, rho_l = odin_penalty(
            scores[:, QUALITY], scores[:, LENGTH], lengths.to(scores.device), heads, corr_weight, ortho_weight
        )
        loss = loss + penalty * pairs
    return loss, [wins(margin.detach()), float(margin.detach().sum()), rho_q * pairs, rho_l * pairs]


def quality_only(model: PreTrainedModel) -> PreTrainedModel:
    """A one-label copy of an ODIN model whose score is its quality head."""
    out: Any = copy.deepcopy(model)
    old = _classifier(out)
    head = torch.nn.Linear(old.in_features, 1, bias=old.bias is not None)
    with torch.no_grad():
        head.weight.copy_(old.weight[QUALITY : QUALITY + 1])
        if old.bias is not None:
            head.bias.copy_(old.bias[QUALITY : QUALITY + 1])
    out.classifier = head
    out.num_labels = 1
    out.config.num_labels = 1
    return out  # type: ignore[no-any-return]


class LengthDebiasedRewardModeling(EncoderRewardModeling):
    """:class:`EncoderRewardModeling` with ``pairs.length_balance`` and ``reward.length_head``
    (see the module docstring). Figures per step: accuracy and margin of the trained reward,
    then ``corr_quality_length`` and ``corr_head_length`` (0 without the length head)."""

    figure_names: tuple[str, ...] = ("accuracy", "margin", "corr_quality_length", "corr_head_length")

    def __init__(self, config: TrainConfig, rank: int, world_size: int, cache_dir: Path) -> None:
        super().__init__(config, rank, world_size, cache_dir)
        self.odin = config.reward.length_head
        groups = strata(self.train_pairs)
        if config.pairs.length_balance == "subsample":
            keep = balance_subsample(groups, config.seed)
            self.train_pairs = [self.train_pairs[i] for i in keep]
            self.train_rows = [self.train_rows[i] for i in keep]
            groups = [groups[i] for i in keep]
            if len(self.train_rows) < config.global_batch_size:
                raise ValueError("pairs.length_balance: fewer pairs than one global batch are left")
            self.sampler = StepSampler(len(self.train_rows), config.global_batch_size, config.seed)
        self.train_weights = (
            balance_weights(groups) if config.pairs.length_balance == "reweight" else [1.0] * len(groups)
        )
        self.train_groups, self.val_groups = groups, strata(self.val_pairs)
        self.strata_counts = {g: groups.count(g) for g in rmlength.STRATA}
        self.train_lengths = [
            (rmlength.words(p.chosen), rmlength.words(p.rejected)) for p in self.train_pairs
        ]
        self.val_lengths = [(rmlength.words(p.chosen), rmlength.words(p.rejected)) for p in self.val_pairs]
        if self.odin:
            self.model = encoder_classifier(
                self.source, config.data.seq_len, self.pad_id, config.init, labels=2
            )

    def collate(
        self, items: Sequence[Any], rows: Sequence[tuple[pairdata.Encoded, ...]] | None = None
    ) -> Micro:
        micro = super().collate(items, rows)
        train = rows is None or rows is self.train_rows
        lengths = self.train_lengths if train else self.val_lengths
        weights = self.train_weights if train else [1.0] * len(self.val_lengths)
        micro["lengths"] = torch.tensor(
            [lengths[i][0] for i in items] + [lengths[i][1] for i in items], dtype=torch.float32
        )
        micro["weight"] = torch.tensor([weights[i] for i in items], dtype=torch.float32)
        groups = self.train_groups if train else self.val_groups
        micro["stratum"] = torch.tensor([rmlength.STRATA.index(groups[i]) for i in items], dtype=torch.long)
        return micro

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """:class:`RewardModeling`'s held-out figures (read at the quality head), and the
        accuracy of each length group: ``pairwise_accuracy_{preferred_longer,preferred_shorter,
        tie}`` with ``_low``/``_high`` (Wilson) and ``eval_pairs_{group}`` (a group with no pair
        has only the count)."""
        self.model.eval()
        groups = len(rmlength.STRATA)
        sums = [0.0] * (4 + 2 * groups)  # loss, wins, margin, pairs; wins and pairs per group
        for micro, counts in self._eval_micro():
            chosen, rejected = self.rewards(self.model, micro)
            margin = chosen - rejected
            if not counts:
                continue
            sums[0] += float(-F.logsigmoid(margin).sum())
            sums[1] += wins(margin)
            sums[2] += float(margin.sum())
            sums[3] += float(margin.numel())
            for k, m in zip(micro["stratum"].tolist(), margin.tolist(), strict=True):
                sums[4 + 2 * k] += 1.0 if m > 0 else 0.5 if m == 0 else 0.0
                sums[5 + 2 * k] += 1.0
        self.model.train()
        loss, correct, margin_sum, n, *by_group = all_reduce(sums, self.world_size)
        overall = rmlength.StratumAccuracy.of(correct, int(n))
        figures = {
            "val_loss": loss / n,
            "pairwise_accuracy": overall.accuracy,
            "pairwise_accuracy_low": overall.ci95_low,
            "pairwise_accuracy_high": overall.ci95_high,
            "val_margin": margin_sum / n,
            "eval_pairs": n,
        }
        for k, name in enumerate(rmlength.STRATA):
            got = rmlength.StratumAccuracy.of(by_group[2 * k], int(by_group[2 * k + 1]))
            figures[f"eval_pairs_{name}"] = float(got.n)
            if not got.n:
                continue  # no NaN figures
            figures[f"pairwise_accuracy_{name}"] = got.accuracy
            figures[f"pairwise_accuracy_{name}_low"] = got.ci95_low
            figures[f"pairwise_accuracy_{name}_high"] = got.ci95_high
        return figures

    def _scores(self, module: torch.nn.Module, micro: Micro) -> torch.Tensor:
        logits = module(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"]).logits
        return logits.float()

    def rewards(self, module: torch.nn.Module, micro: Micro) -> tuple[torch.Tensor, torch.Tensor]:
        """The exported score of chosen and rejected: the quality head alone under ODIN."""
        chosen, rejected = self._scores(module, micro)[:, QUALITY].chunk(2)
        return chosen, rejected

    def loss(self, module: torch.nn.Module, micro: Micro) -> tuple[torch.Tensor, list[float]]:
        reward = self.config.reward
        return debiased_loss(
            self._scores(module, micro),
            micro["weight"],
            micro["lengths"],
            _classifier(module).weight if self.odin else None,
            reward.length_corr_weight,
            reward.length_ortho_weight,
        )

    def model_meta(self) -> dict[str, Any]:
        return {
            **super().model_meta(),
            "length_balance": self.config.pairs.length_balance,
            "length_head": self.odin,
            "train_strata": dict(self.strata_counts),
        }

    def export(self, out_dir: Path, model: PreTrainedModel | None = None) -> Path:
        chosen = model or self.model
        return super().export(out_dir, quality_only(chosen) if self.odin else chosen)


def _classifier(module: torch.nn.Module) -> torch.nn.Linear:
    """The classifier of a (possibly DDP-wrapped) ``BertForSequenceClassification``."""
    inner = getattr(module, "module", module)
    head = inner.classifier
    assert isinstance(head, torch.nn.Linear)
    return head


def build(config: TrainConfig, rank: int, world_size: int, cache_dir: Path) -> Objective:
    """A ``reward`` objective: :class:`LengthDebiasedRewardModeling` on a bundled encoder (the
    plain encoder reward model when neither debias option is set), else the parent's
    :class:`~.reward.RewardModeling`."""
    if config.init.backbone != "parent":
        return LengthDebiasedRewardModeling(config, rank, world_size, cache_dir)
    return RewardModeling(config, rank, world_size)


SPEC = ObjectiveSpec(
    "reward", build, "a scalar-head reward model (the parent's backbone or a bundled encoder)"
)
