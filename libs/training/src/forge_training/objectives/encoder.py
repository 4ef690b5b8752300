"""Bundled encoders under a new one-output head: what the encoder reward model and the
cross-encoder reranker build on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification, PreTrainedModel

from forge_training.schema import InitConfig


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
