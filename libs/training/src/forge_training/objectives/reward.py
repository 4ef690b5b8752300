"""The ``reward`` task: a Bradley-Terry reward model, on the parent's backbone or on a bundled
encoder (``init.backbone``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedModel

from forge_training import pairs as pairdata
from forge_training.backbones import BACKBONE_NAMES, backbone_dir
from forge_training.mfu import train_flops_per_token
from forge_training.objectives.base import Micro, Objective, wins
from forge_training.objectives.encoder import encoder_classifier, encoder_head_prefixes, save_encoder
from forge_training.objectives.pairwise import PreferenceTask
from forge_training.parents import Parent
from forge_training.schema import TrainConfig


class RewardModeling(PreferenceTask):
    """The parent's backbone with a scalar head (``LlamaForSequenceClassification``, one label,
    pooled at the last non-padding token); Bradley-Terry loss ``-log sigmoid(r_chosen -
    r_rejected)``. Inputs end with the response's last token (no end-of-text: it is the padding
    token, which the head's pooling skips). Accuracy counts a tie as one half (:func:`wins`)."""

    task = "reward"
    end_of_text = False
    figure_names: tuple[str, ...] = ("accuracy", "margin")
    accuracy_name, margin_name = "pairwise_accuracy", "val_margin"

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

    def margins(self, module: torch.nn.Module, micro: Micro) -> torch.Tensor:
        chosen, rejected = self.rewards(module, micro)
        return chosen - rejected

    def loss(self, module: torch.nn.Module, micro: Micro) -> tuple[torch.Tensor, list[float]]:
        margin = self.margins(module, micro)
        loss = -F.logsigmoid(margin).sum()
        return loss, [wins(margin.detach()), float(margin.detach().sum())]


class EncoderRewardModeling(RewardModeling):
    """A reward model from a pre-trained BERT encoder (``init.backbone``; ``minilm`` =
    all-MiniLM-L6-v2): ``BertForSequenceClassification`` with one label, the encoder's weights and
    a new head (pooler at ``[CLS]``, then a linear score), its own WordPiece tokenizer. Inputs are
    ``[CLS] prompt + response [SEP]`` cut from the left to ``data.seq_len`` (see
    :func:`pairs.encode_pairs_for_encoder`), right-padded with ``[PAD]``. Loss, accuracy and its
    Wilson interval are :class:`RewardModeling`'s.

    Rank 0 writes the held-out pairs to ``<cache dir>/held_out_pairs.jsonl`` (HH-RLHF format), the
    file to score the export with (``forge rm eval --pairs``), and with ``pairs.extra_val_fraction``
    the held-out share of ``pairs.extra_train`` to ``held_out_extra_pairs.jsonl``, and the pairs it
    trains on (before any ``pairs.length_balance``) to ``train_pairs.jsonl``, the file
    :mod:`forge_training.rm.residual` fits a length correction on; the export carries the tokenizer
    with ``truncation_side="left"``, ``model_max_length = data.seq_len`` and
    :data:`pairs.ENCODER_CHAT_TEMPLATE`, so ``forge rm eval`` encodes pairs as training did."""

    HELD_OUT_FILE = "held_out_pairs.jsonl"
    HELD_OUT_EXTRA_FILE = "held_out_extra_pairs.jsonl"
    TRAIN_FILE = "train_pairs.jsonl"

    def __init__(self, config: TrainConfig, rank: int, world_size: int, cache_dir: Path) -> None:
        Objective.__init__(self, config, rank, world_size)  # no parent: not PairTask.__init__
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
            pairdata.write_pairs(cache_dir / self.TRAIN_FILE, self.train_pairs)
            if config.pairs.extra_val_fraction:
                _, extra_held = pairdata.split_extra(config.pairs, config.seed)
                pairdata.write_pairs(cache_dir / self.HELD_OUT_EXTRA_FILE, extra_held)
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
