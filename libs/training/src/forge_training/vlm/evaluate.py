"""Scoring a VLM by generation: VQA exact match (with or without the image: the text-only
control), captions by BLEU-4. Greedy decoding, left-padded batches."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import LlavaForConditionalGeneration

from forge_training.device import on_model_device
from forge_training.vlm import metrics
from forge_training.vlm.images import preprocess
from forge_training.vlm.model import content_text
from forge_training.vlm.shards import Sample
from forge_training.vlm.tokens import SequenceEncoder


@dataclass
class Scored:
    predictions: list[str]
    references: list[str]
    scores: list[float]
    """Per item: exact match (VQA) or sentence BLEU-4 (captions)."""
    groups: list[str] = field(default_factory=list)

    @property
    def mean(self) -> float:
        return sum(self.scores) / max(len(self.scores), 1)


def _without_images(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = [p for p in content if p.get("type") == "text"]
        out.append({**m, "content": content})
    return out


@torch.no_grad()
def answer(
    model: LlavaForConditionalGeneration,
    encoder: SequenceEncoder,
    prompts: Sequence[list[dict[str, Any]]],
    images: Sequence[list[bytes]],
    max_new_tokens: int,
) -> list[str]:
    """Greedy replies to each chat prompt (messages before the reply) with its images."""
    rows = [encoder.prompt_ids(p) for p in prompts]
    width = max(len(r) for r in rows)
    pad = encoder.eot
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    flat = [preprocess(b, encoder.spec) for imgs in images for b in imgs]
    extra = {"pixel_values": torch.stack(flat)} if flat else {}  # none at all: text only
    was_training = model.training
    model.eval()
    inputs = on_model_device({"input_ids": ids, "attention_mask": mask, **extra}, model)
    out = model.generate(
        **inputs,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=pad,
        pad_token_id=pad,
    )
    model.train(was_training)
    replies = []
    for row in out[:, width:].tolist():
        cut = row.index(pad) if pad in row else len(row)
        replies.append(encoder.tok.decode(row[:cut]).strip())
    return replies


def score_chats(
    model: LlavaForConditionalGeneration,
    encoder: SequenceEncoder,
    samples: Sequence[Sample],
    *,
    with_image: bool = True,
    captions: bool = False,
    max_new_tokens: int = 8,
    batch_size: int = 32,
) -> Scored:
    """Generate the final assistant turn of each chat sample and score it against the sample's
    (exact match, or sentence BLEU-4 with ``captions``); ``with_image=False`` drops the image
    parts and images (the text-only control)."""
    preds: list[str] = []
    refs: list[str] = []
    groups: list[str] = []
    for start in range(0, len(samples), batch_size):
        chunk = samples[start : start + batch_size]
        prompts = [s.messages[:-1] if with_image else _without_images(s.messages[:-1]) for s in chunk]
        imgs = [s.images if with_image else [] for s in chunk]
        preds.extend(answer(model, encoder, prompts, imgs, max_new_tokens))
        refs.extend(content_text(s.messages[-1]["content"]) for s in chunk)
        groups.extend(str(s.meta.get("qtype", "")) for s in chunk)
    if captions:
        scores = [metrics.sentence_bleu4(p, r) for p, r in zip(preds, refs, strict=True)]
    else:
        scores = metrics.exact_matches(preds, refs)
    return Scored(preds, refs, scores, groups)
