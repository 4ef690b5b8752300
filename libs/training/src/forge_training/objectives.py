"""Training objectives: what each task trains, on which data, with which loss and evaluation.

The loop in :mod:`train` is the same for every task; an :class:`Objective` supplies what
differs. :func:`build_objective` makes one on every rank after the seeds are set; the loop then
calls :meth:`Objective.draw` (in the prefetch thread), :meth:`Objective.loss` for each
micro-batch, :meth:`Objective.evaluate` on the eval interval and :meth:`Objective.export` at
the end.

Loss convention: :meth:`Objective.loss` returns the *sum* over its micro-batch's loss units
(target tokens for language modelling, pairs for reward and DPO) and figure sums over the same
units; the loop divides by the step's global number of units, so a step's gradient is the same
mean for any world size and micro-batch split.
"""

from __future__ import annotations

import copy
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers import (
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PreTrainedModel,
)

from forge_training import pairs as pairdata
from forge_training.backbones import BACKBONE_NAMES, backbone_dir
from forge_training.collectives import all_reduce, barrier
from forge_training.data import (
    EOT,
    MixtureSampler,
    PreparedData,
    StepSampler,
    TokenShards,
    prepare,
)
from forge_training.dpo_monitor import DpoMonitor
from forge_training.export import export_hf
from forge_training.mfu import forward_flops_per_token, train_flops_per_token
from forge_training.parents import Parent, load_parent
from forge_training.recipes import InitConfig, TrainConfig

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


def wilson_interval(successes: float, n: float, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95 % for ``z`` = 1.96)."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def wins(margin: torch.Tensor) -> float:
    """Pairs ranked right: a positive margin counts one, a tie (as every pair at DPO's step 0)
    one half."""
    return float((margin > 0).sum()) + 0.5 * float((margin == 0).sum())


def spread(n: int, count: int) -> list[int]:
    """``count`` indices evenly spread over ``range(n)`` (a fixed evaluation set)."""
    return [int(i) for i in np.linspace(0, n - 1, min(count, n)).astype(np.int64)]


def _prepare_rank0_first(world_size: int, rank: int, make: Callable[[], PreparedData]) -> PreparedData:
    if rank == 0:
        prepared = make()
    barrier(world_size)
    if rank != 0:
        prepared = make()
    return prepared


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

    def model_meta(self) -> dict[str, Any]:
        return {"task": self.task, "model_config": self.model.config.to_dict()}

    def head_prefixes(self) -> tuple[str, ...]:
        """Parameter-name prefixes of a freshly initialised head, which learns
        ``optim.head_lr_scale`` times faster than the rest (none by default)."""
        return ()


# -- bundled encoders under a new one-output head: encoder reward models, cross-encoders ----------


def encoder_classifier(
    source: Path, seq_len: int, pad_id: int, init: InitConfig, labels: int = 1
) -> PreTrainedModel:
    """``BertForSequenceClassification`` with ``labels`` outputs (one by default) from the encoder
    folder ``source``: its weights, a new pooler-and-linear head read at ``[CLS]``;
    ``init.encoder_dropout`` (-1: the encoder's own) and ``init.freeze_embeddings`` applied."""
    config = BertConfig.from_pretrained(source, num_labels=labels)
    if seq_len > config.max_position_embeddings:
        raise ValueError(
            f"data.seq_len: {seq_len} exceeds the encoder's {config.max_position_embeddings} positions"
        )
    if init.encoder_dropout >= 0:
        config.hidden_dropout_prob = config.attention_probs_dropout_prob = init.encoder_dropout
    model = BertForSequenceClassification.from_pretrained(source, config=config, dtype=torch.float32)
    model.config.pad_token_id = pad_id
    if init.freeze_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
    model.train()
    return model


def encoder_head_prefixes(model: PreTrainedModel) -> tuple[str, ...]:
    """The new head of :func:`encoder_classifier`'s model: its pooler and its classifier."""
    return ("classifier.", f"{model.base_model_prefix}.pooler.")


def save_encoder(
    model: PreTrainedModel, source: Path, out_dir: Path, seq_len: int, **tokenizer_attrs: Any
) -> Path:
    """``model`` in Hugging Face format with ``source``'s tokenizer, which cuts at ``seq_len``
    (``model_max_length``) and neither pads nor truncates by itself (the source's
    ``tokenizer.json`` pads and cuts at 128); ``tokenizer_attrs`` are set on the tokenizer."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.backend_tokenizer.no_truncation()
    tokenizer.backend_tokenizer.no_padding()
    tokenizer.model_max_length = seq_len
    for name, value in tokenizer_attrs.items():
        setattr(tokenizer, name, value)
    tokenizer.save_pretrained(out_dir)
    return out_dir


# -- language modelling: pretrain and continual pre-training -----------------------------------


def rank_batches(items: Sequence[int], rank: int, world_size: int, size: int) -> list[tuple[list[int], bool]]:
    """This rank's share ``items[rank::world_size]`` in batches of ``size``, each with whether it
    counts. Ranks with fewer batches than rank 0 get repeats of ``items[0]`` that do not count:
    under FSDP every forward all-gathers parameters, so every rank must run the same number of
    forwards or the collectives hang."""
    mine = list(items[rank::world_size])
    batches = [(mine[i : i + size], True) for i in range(0, len(mine), size)]
    most = math.ceil(len(items[0::world_size]) / size)
    return batches + [([items[0]], False)] * (most - len(batches))


def _lm_batch(split: TokenShards, windows: Sequence[int], seq_len: int) -> Micro:
    rows = torch.from_numpy(np.stack([split.window(i, seq_len) for i in windows]))
    x, y = rows[:, :-1], rows[:, 1:]
    return {"input_ids": x, "labels": y, "attention_mask": torch.ones_like(x)}


def _lm_loss_sum(module: torch.nn.Module, micro: Micro) -> torch.Tensor:
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
        micro = _lm_batch(split, batch, seq_len)
        loss = float(_lm_loss_sum(model, micro))
        if counts:
            total += loss
            tokens += micro["labels"].numel()
    model.train(was_training)
    total, tokens = all_reduce([total, tokens], world_size)
    return total / tokens


class Pretraining(Objective):
    """Causal LM from scratch on ``data.corpus`` with its own byte-level BPE."""

    task = "pretrain"

    def __init__(self, config: TrainConfig, rank: int, world_size: int, cache_dir: Path) -> None:
        super().__init__(config, rank, world_size)
        prepared = _prepare_rank0_first(world_size, rank, lambda: prepare(config.data, cache_dir))
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
        return _lm_batch(self.train_split, items, self.config.data.seq_len)

    def units(self, micro: Micro) -> float:
        return float(micro["labels"].numel())

    def flops(self, micro: Micro) -> float:
        return float(micro["labels"].numel()) * self._flops_per_token

    def loss(self, module: torch.nn.Module, micro: Micro) -> tuple[torch.Tensor, list[float]]:
        return _lm_loss_sum(module, micro), []

    def evaluate(self) -> dict[str, float]:
        val = evaluate_lm(self.model, self.val_split, self.config, self.rank, self.world_size)
        return {"val_loss": val, "val_ppl": math.exp(min(val, 50.0))}

    def export(self, out_dir: Path, model: PreTrainedModel | None = None) -> Path:
        return export_hf(model or self.model, Tokenizer.from_str(self.tokenizer_json), out_dir)


def _adopt(parent: Parent, seq_len: int) -> LlamaForCausalLM:
    """The parent's model, train mode, with room for ``seq_len`` positions in its config."""
    model = parent.model
    model.config.max_position_embeddings = max(model.config.max_position_embeddings, seq_len)
    model.train()
    return model


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

        domain = _prepare_rank0_first(world_size, rank, both)
        general = prepare(general_cfg, cache_dir, self.tokenizer_json)  # cached by now
        self.data_hash = f"{domain.data_hash}+{general.data_hash}"
        self.splits = {
            "train": (domain.split("train"), general.split("train")),
            "val": (domain.split("val"), general.split("val")),
        }
        self.chars_per_token = self.splits["val"][self.DOMAIN].chars_per_token
        seq_len = config.data.seq_len
        self.model = _adopt(parent, seq_len)
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
        return _lm_loss_sum(module, micro), [general_tokens]

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


# -- prompt/response tasks ---------------------------------------------------------------------


def _pad(rows: Sequence[pairdata.Encoded], pad_id: int, mask_prompt: bool) -> Micro:
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


class _PairTask(Objective):
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
        return [(self.collate(items, self.val_rows), counts) for items, counts in batches]

    @abstractmethod
    def collate(
        self, items: Sequence[Any], rows: Sequence[tuple[pairdata.Encoded, ...]] | None = None
    ) -> Micro: ...

    def export(self, out_dir: Path, model: PreTrainedModel | None = None) -> Path:
        return export_hf(
            model or self.model, Tokenizer.from_str(self.tokenizer_json), out_dir, pairdata.CHAT_TEMPLATE
        )


class SupervisedFineTuning(_PairTask):
    """The parent's causal LM on chosen conversations; loss on the final response tokens only."""

    task = "sft"
    chosen_only = True

    def make_model(self, parent: Parent) -> PreTrainedModel:
        return _adopt(parent, self.config.data.seq_len)

    def collate(
        self, items: Sequence[Any], rows: Sequence[tuple[pairdata.Encoded, ...]] | None = None
    ) -> Micro:
        source = self.train_rows if rows is None else rows
        return _pad([source[i][0] for i in items], self.pad_id, mask_prompt=True)

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


class _PreferenceTask(_PairTask):
    def collate(
        self, items: Sequence[Any], rows: Sequence[tuple[pairdata.Encoded, ...]] | None = None
    ) -> Micro:
        source = self.train_rows if rows is None else rows
        chosen = [source[i][0] for i in items]
        rejected = [source[i][1] for i in items]
        return _pad(chosen + rejected, self.pad_id, mask_prompt=True)  # rows [chosen..., rejected...]

    def units(self, micro: Micro) -> float:
        return float(micro["input_ids"].size(0) // 2)


class RewardModeling(_PreferenceTask):
    """The parent's backbone with a scalar head (``LlamaForSequenceClassification``, one label,
    pooled at the last non-padding token); Bradley-Terry loss ``-log sigmoid(r_chosen -
    r_rejected)``. Inputs end with the response's last token (no end-of-text: it is the padding
    token, which the head's pooling skips). Accuracy counts a tie as one half (:func:`wins`)."""

    task = "reward"
    end_of_text = False
    figure_names: tuple[str, ...] = ("accuracy", "margin")

    def make_model(self, parent: Parent) -> PreTrainedModel:
        backbone = parent.model
        rm_config = LlamaConfig.from_dict(backbone.config.to_dict())
        rm_config.num_labels = 1
        rm_config.pad_token_id = self.pad_id
        rm_config.max_position_embeddings = max(rm_config.max_position_embeddings, self.config.data.seq_len)
        rm_config.architectures = ["LlamaForSequenceClassification"]
        model = LlamaForSequenceClassification(rm_config)
        model.model.load_state_dict(backbone.model.state_dict())
        model.train()
        return model

    def flops(self, micro: Micro) -> float:
        per_token = train_flops_per_token(self.model.config, 1, micro["input_ids"].size(1))
        return float(micro["attention_mask"].sum()) * per_token

    def rewards(self, module: torch.nn.Module, micro: Micro) -> tuple[torch.Tensor, torch.Tensor]:
        scores = module(
            input_ids=micro["input_ids"], attention_mask=micro["attention_mask"], use_cache=False
        ).logits
        chosen, rejected = scores.squeeze(-1).float().chunk(2)
        return chosen, rejected

    def loss(self, module: torch.nn.Module, micro: Micro) -> tuple[torch.Tensor, list[float]]:
        chosen, rejected = self.rewards(module, micro)
        margin = chosen - rejected
        loss = -F.logsigmoid(margin).sum()
        return loss, [wins(margin.detach()), float(margin.detach().sum())]

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.model.eval()
        sums = [0.0, 0.0, 0.0, 0.0]  # loss, correct, margin, pairs
        for micro, counts in self._eval_micro():
            chosen, rejected = self.rewards(self.model, micro)
            margin = chosen - rejected
            if not counts:
                continue
            sums = [
                sums[0] + float(-F.logsigmoid(margin).sum()),
                sums[1] + wins(margin),
                sums[2] + float(margin.sum()),
                sums[3] + float(margin.numel()),
            ]
        self.model.train()
        loss, correct, margin_sum, n = all_reduce(sums, self.world_size)
        low, high = wilson_interval(correct, n)
        return {
            "val_loss": loss / n,
            "pairwise_accuracy": correct / n,
            "pairwise_accuracy_low": low,
            "pairwise_accuracy_high": high,
            "val_margin": margin_sum / n,
            "eval_pairs": n,
        }


class EncoderRewardModeling(RewardModeling):
    """A reward model from a pre-trained BERT encoder (``init.backbone``; ``minilm`` =
    all-MiniLM-L6-v2): ``BertForSequenceClassification`` with one label, the encoder's weights and
    a new head (pooler at ``[CLS]``, then a linear score), its own WordPiece tokenizer. Inputs are
    ``[CLS] prompt + response [SEP]`` cut from the left to ``data.seq_len`` (see
    :func:`pairs.encode_pairs_for_encoder`), right-padded with ``[PAD]``. Loss, accuracy and its
    Wilson interval are :class:`RewardModeling`'s.

    Rank 0 writes the held-out pairs to ``<cache dir>/held_out_pairs.jsonl`` (HH-RLHF format), the
    file to score the export with (``forge rm eval --pairs``); the export carries the tokenizer
    with ``truncation_side="left"``, ``model_max_length = data.seq_len`` and
    :data:`pairs.ENCODER_CHAT_TEMPLATE`, so ``forge rm eval`` encodes pairs as training did."""

    HELD_OUT_FILE = "held_out_pairs.jsonl"

    def __init__(self, config: TrainConfig, rank: int, world_size: int, cache_dir: Path) -> None:
        Objective.__init__(self, config, rank, world_size)
        self.source = backbone_dir(config.init.backbone)
        self.tokenizer_json = (self.source / "tokenizer.json").read_text(encoding="utf-8")
        tok = Tokenizer.from_str(self.tokenizer_json)

        def special(name: str) -> int:
            found = tok.token_to_id(name)
            if found is None:
                raise ValueError(f"init.backbone: the {config.init.backbone!r} tokenizer has no {name}")
            return int(found)

        cls_id, sep_id, self.pad_id = special("[CLS]"), special("[SEP]"), special("[PAD]")
        seq_len = config.data.seq_len
        self._prepare_pairs(
            lambda pairs: pairdata.encode_pairs_for_encoder(tok, pairs, seq_len, cls_id, sep_id)
        )
        if rank == 0:
            self.held_out_file = pairdata.write_pairs(cache_dir / self.HELD_OUT_FILE, self.val_pairs)
        self.model = encoder_classifier(self.source, seq_len, self.pad_id, config.init)

    def make_model(self, parent: Parent) -> PreTrainedModel:  # pragma: no cover - no parent here
        raise TypeError("an encoder reward model has no parent")

    def head_prefixes(self) -> tuple[str, ...]:
        return encoder_head_prefixes(self.model)

    def rewards(self, module: torch.nn.Module, micro: Micro) -> tuple[torch.Tensor, torch.Tensor]:
        scores = module(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"]).logits
        chosen, rejected = scores.squeeze(-1).float().chunk(2)
        return chosen, rejected

    def model_meta(self) -> dict[str, Any]:
        return {**super().model_meta(), "backbone": BACKBONE_NAMES.get(self.config.init.backbone, "")}

    def export(self, out_dir: Path, model: PreTrainedModel | None = None) -> Path:
        return save_encoder(
            model or self.model,
            self.source,
            out_dir,
            self.config.data.seq_len,
            truncation_side="left",
            chat_template=pairdata.ENCODER_CHAT_TEMPLATE,
        )


class DirectPreference(_PreferenceTask):
    """DPO, sigmoid loss: ``-log sigmoid(beta ((log pi(y_c) - log ref(y_c)) - (log pi(y_r) -
    log ref(y_r))))``, log-probabilities summed over response tokens; the reference is a frozen
    copy of the parent (Rafailov et al. 2023; TRL's ``loss_type="sigmoid"`` computes the same)."""

    task = "dpo"
    figure_names = (
        "reward_chosen",
        "reward_rejected",
        "reward_margin",
        "reward_accuracy",
        "logratio_chosen",
        "logratio_rejected",
    )

    def make_model(self, parent: Parent) -> PreTrainedModel:
        model = _adopt(parent, self.config.data.seq_len)
        self.reference = copy.deepcopy(model).eval()
        for p in self.reference.parameters():
            p.requires_grad_(False)
        self.beta = self.config.dpo.beta
        self.monitor: DpoMonitor | None = None
        watch = self.config.dpo.monitor
        if watch.interval:
            # Held-out prompts: those of the pairs DPO does not train on (its validation split).
            prompts = [rows[0].ids[: rows[0].prompt_len] for rows in self.val_rows[: watch.prompts]]
            self.monitor = DpoMonitor(
                reward_model=watch.reward_model,
                reference=self.reference,
                prompts=prompts,
                eos_id=self.pad_id,
                interval=watch.interval,
                window=watch.window,
                max_new_tokens=watch.max_new_tokens,
                out=watch.out,
                seed=self.config.seed,
                write=self.rank == 0,
            )
        return model

    def start(self) -> dict[str, float]:
        baseline = self.evaluate()
        if self.monitor is not None:  # the reference point: KL 0, the starting proxy reward
            self.monitor.measure(0, self.model, baseline["val_reward_accuracy"])
        return baseline

    def early_stop(self, step: int) -> str:
        """Every ``dpo.monitor.interval`` steps: a monitor point; its reason once over-optimisation shows."""
        if self.monitor is None or not self.monitor.due(step):
            return ""
        self.monitor.measure(step, self.model, self.evaluate()["val_reward_accuracy"])
        return self.monitor.stop_reason

    def flops(self, micro: Micro) -> float:
        cfg, width = self.model.config, micro["input_ids"].size(1)
        per_token = train_flops_per_token(cfg, cfg.vocab_size, width) + forward_flops_per_token(
            cfg, cfg.vocab_size, width
        )
        return float(micro["attention_mask"].sum()) * per_token

    def logratios(self, module: torch.nn.Module, micro: Micro) -> tuple[torch.Tensor, torch.Tensor]:
        """Per pair: log pi - log ref of the chosen and of the rejected response."""
        kwargs = {
            "input_ids": micro["input_ids"],
            "attention_mask": micro["attention_mask"],
            "use_cache": False,
        }
        policy, _ = sequence_logps(module(**kwargs).logits, micro["labels"])
        with torch.no_grad():
            reference, _ = sequence_logps(self.reference(**kwargs).logits, micro["labels"])
        ratio = policy - reference
        chosen, rejected = ratio.chunk(2)
        return chosen, rejected

    def loss(self, module: torch.nn.Module, micro: Micro) -> tuple[torch.Tensor, list[float]]:
        chosen, rejected = self.logratios(module, micro)
        margin = self.beta * (chosen - rejected)
        loss = -F.logsigmoid(margin).sum()
        c, r = chosen.detach(), rejected.detach()
        return loss, [
            float(self.beta * c.sum()),
            float(self.beta * r.sum()),
            float(margin.detach().sum()),
            wins(c - r),
            float(c.sum()),
            float(r.sum()),
        ]

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.model.eval()
        sums = [0.0, 0.0, 0.0, 0.0]  # loss, correct, margin, pairs
        for micro, counts in self._eval_micro():
            chosen, rejected = self.logratios(self.model, micro)
            margin = self.beta * (chosen - rejected)
            if not counts:
                continue
            sums = [
                sums[0] + float(-F.logsigmoid(margin).sum()),
                sums[1] + wins(margin),
                sums[2] + float(margin.sum()),
                sums[3] + float(margin.numel()),
            ]
        self.model.train()
        loss, correct, margin_sum, n = all_reduce(sums, self.world_size)
        low, high = wilson_interval(correct, n)
        return {
            "val_loss": loss / n,
            "val_reward_accuracy": correct / n,
            "val_reward_accuracy_low": low,
            "val_reward_accuracy_high": high,
            "val_reward_margin": margin_sum / n,
            "eval_pairs": n,
        }


def build_objective(config: TrainConfig, rank: int, world_size: int, cache_dir: Path) -> Objective:
    """The :class:`Objective` of ``config.task`` (data prepared, model built or loaded)."""
    if config.task == "pretrain":
        return Pretraining(config, rank, world_size, cache_dir)
    if config.task == "cpt":
        return ContinualPretraining(config, rank, world_size, cache_dir)
    if config.task == "sft":
        return SupervisedFineTuning(config, rank, world_size)
    if config.task == "reward" and config.init.backbone != "parent":
        from forge_training.lengthdebias import LengthDebiasedRewardModeling  # builds on this

        return LengthDebiasedRewardModeling(config, rank, world_size, cache_dir)
    if config.task == "reward":
        return RewardModeling(config, rank, world_size)
    if config.task == "dpo":
        return DirectPreference(config, rank, world_size)
    if config.task == "rerank":
        from forge_training.rerank import CrossEncoderRanking  # it builds on this module

        return CrossEncoderRanking(config, rank, world_size)
    raise ValueError(f"task: unknown task {config.task!r}")
