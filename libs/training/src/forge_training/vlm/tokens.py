"""Samples to token streams: each image a placeholder that expands to ``image_seq_length``
copies of ``<image>``'s id (the LLaVA layout, which the model fills with the image's projected
patches), labels on the text the task trains on, and batches with their pixel values.

Matching is strict: every image of a sample must be placed exactly once (``{"image": i}`` in a
document, an image part in a chat) and no text may contain a literal ``<image>`` (a placeholder
without an image); either mismatch, a sequence longer than ``seq_len`` or an image
:mod:`images` refuses raises :class:`~forge_training.vlm.shards.ItemError` naming the item, and
:func:`encode_batch` drops that item and keeps the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tokenizers import Tokenizer

from forge_training.data import EOT
from forge_training.vlm.images import ImageError, ImageSpec, preprocess
from forge_training.vlm.model import IMAGE_TOKEN, LoadedVlm, content_text, render_chat
from forge_training.vlm.shards import ItemError, Sample

IGNORE = -100


@dataclass
class Encoded:
    ids: list[int]
    labels: list[int]
    """``IGNORE`` where no loss is taken; otherwise the token itself (the loss shifts)."""
    pixels: torch.Tensor
    """``[images, 3, size, size]`` in placeholder order."""
    name: str


class SequenceEncoder:
    """Turns :class:`Sample` s into :class:`Encoded` sequences for one tokenizer and image spec."""

    def __init__(
        self, tokenizer: Tokenizer, image_token_id: int, image_seq_length: int, spec: ImageSpec, seq_len: int
    ) -> None:
        self.tok, self.image_id, self.per_image = tokenizer, image_token_id, image_seq_length
        self.spec, self.seq_len = spec, seq_len
        eot = tokenizer.token_to_id(EOT)
        if eot is None:
            raise ValueError(f"the tokenizer has no {EOT} token")
        self.eot = int(eot)

    @classmethod
    def of(cls, loaded: LoadedVlm, seq_len: int) -> SequenceEncoder:
        """The encoder of a loaded VLM export: its tokenizer, image token, image length and spec."""
        return cls(loaded.tokenizer, loaded.image_token_id, loaded.image_seq_length, loaded.spec, seq_len)

    def text_ids(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def expand(self, ids: Sequence[int]) -> list[int]:
        """``ids`` with each ``<image>`` id repeated ``image_seq_length`` times."""
        out: list[int] = []
        for i in ids:
            out.extend([i] * self.per_image if i == self.image_id else [i])
        return out

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The generation prompt of a chat (image parts expanded), as serving builds it."""
        return self.expand(self.text_ids(render_chat(messages, add_generation_prompt=True)))

    def encode(self, sample: Sample, name: str) -> Encoded:
        ids, labels = self._chat(sample, name) if sample.kind == "chat" else self._segments(sample, name)
        if len(ids) > self.seq_len:
            raise ItemError(name, f"{len(ids)} tokens, over data.seq_len {self.seq_len}")
        pixels = []
        for i, data in enumerate(sample.images):
            try:
                pixels.append(preprocess(data, self.spec))
            except ImageError as exc:
                raise ItemError(name, f"image {i}: {exc}") from None
        stacked = torch.stack(pixels) if pixels else torch.zeros(0, 3, self.spec.size, self.spec.size)
        return Encoded(ids, labels, stacked, name)

    def _check_text(self, text: str, name: str) -> None:
        if IMAGE_TOKEN in text:
            raise ItemError(name, f"a {IMAGE_TOKEN} placeholder in the text with no image for it")

    def _segments(self, sample: Sample, name: str) -> tuple[list[int], list[int]]:
        ids: list[int] = []
        labels: list[int] = []
        placed: list[int] = []
        for seg in sample.segments:
            if "image" in seg:
                index = seg["image"]
                if not isinstance(index, int) or not 0 <= index < len(sample.images):
                    raise ItemError(name, f"an image placeholder ({index!r}) with no image for it")
                if index in placed:
                    raise ItemError(name, f"image {index} placed twice")
                placed.append(index)
                ids.extend([self.image_id] * self.per_image)
                labels.extend([IGNORE] * self.per_image)
            elif isinstance(seg.get("text"), str):
                self._check_text(seg["text"], name)
                part = self.text_ids(seg["text"])
                ids.extend(part)
                labels.extend(part)
            else:
                raise ItemError(name, f"a segment that is neither text nor image: {seg!r}")
        missing = sorted(set(range(len(sample.images))) - set(placed))
        if missing:
            raise ItemError(name, f"image(s) {missing} without a placeholder")
        if placed != sorted(placed):
            raise ItemError(name, "images placed out of order (image i must come before image i+1)")
        return [*ids, self.eot], [*labels, self.eot]

    def _chat(self, sample: Sample, name: str) -> tuple[list[int], list[int]]:
        messages = sample.messages
        if messages[-1].get("role") != "assistant" or not isinstance(messages[-1].get("content"), str):
            raise ItemError(name, "a chat must end with an assistant message of text")
        images = 0
        for m in messages:
            if m.get("role") not in ("user", "assistant"):
                raise ItemError(name, f"unknown role {m.get('role')!r}")
            content = m.get("content")
            parts = content if isinstance(content, list) else [{"type": "text", "text": content}]
            for part in parts:
                if isinstance(part, dict) and part.get("type") in ("image", "image_url"):
                    images += 1
                elif isinstance(part, dict) and isinstance(part.get("text"), str):
                    self._check_text(part["text"], name)
                else:
                    raise ItemError(name, f"unknown content part {part!r}")
        if images != len(sample.images):
            what = (
                "image part(s) without an image"
                if images > len(sample.images)
                else "image(s) without an image part"
            )
            raise ItemError(name, f"{abs(images - len(sample.images))} {what}")
        try:
            prompt = self.prompt_ids(messages[:-1])
            answer = content_text(messages[-1]["content"])
        except ValueError as exc:
            raise ItemError(name, str(exc)) from None
        response = self.text_ids(f" {answer}{EOT}\n")
        return prompt + response, [IGNORE] * len(prompt) + response


def collate(rows: Sequence[Encoded], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask``, ``labels`` and the images of all rows in
    order (``pixel_values``, ``[total images, 3, size, size]``; LLaVA fills the placeholders
    of the flattened batch in that order)."""
    width = max(len(r.ids) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r.ids)] = torch.tensor(r.ids)
        labels[i, : len(r.labels)] = torch.tensor(r.labels)
        mask[i, : len(r.ids)] = 1
    pixels = torch.cat([r.pixels for r in rows]) if rows else torch.zeros(0)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "pixel_values": pixels}


def encode_batch(
    encoder: SequenceEncoder, samples: Sequence[tuple[Sample, str]]
) -> tuple[list[Encoded], list[ItemError]]:
    """Each (sample, name) encoded; the bad ones as errors, the others kept."""
    good: list[Encoded] = []
    bad: list[ItemError] = []
    for sample, name in samples:
        try:
            good.append(encoder.encode(sample, name))
        except ItemError as exc:
            bad.append(exc)
    return good, bad
