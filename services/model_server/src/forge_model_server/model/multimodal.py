"""Images inside the engine: where each sits in a prompt, its part of the prefix-cache key, and the
embeddings a step feeds the model in place of its placeholder tokens.

A prompt with images holds, per image, ``image_seq_length`` placeholder tokens (the ``<image>``
token id) at ``offset``; the :class:`ImageSpan` carries the image's pixel values, its content hash
and, once the vision encoder has run on it, its embeddings. The engine:

- keys each full prompt block by its tokens, everything before them, *and* the (hash, position)
  of every image piece inside it (:func:`block_hashes`), so two prompts with the same text but
  different images never share a cached block (vLLM's multimodal block-hash extra keys);
- in each step, finds the image pieces inside the scheduled chunks (:func:`step_images`),
  encodes the images not encoded yet in one batch of the vision tower (:func:`embed_rows`), and
  overwrites the placeholders' token embeddings with them: a chunked prefill may cut an image in
  two, each chunk gets its rows;
- drops an image's embeddings once its whole span is in the KV cache (a preempted sequence
  re-encodes from the pixel values it keeps).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass
class ImageSpan:
    """One image of a prompt: placeholder positions ``[offset, offset + length)``."""

    offset: int
    length: int
    key: str
    """The image's content hash (sha256 of its encoded bytes)."""
    pixel_values: torch.Tensor
    embeds: torch.Tensor | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class ImageSlice:
    """The rows ``[lo, hi)`` of an image's embeddings that fill flat batch rows from ``row``."""

    image: ImageSpan
    lo: int
    hi: int
    row: int


Encode = Callable[[list[torch.Tensor]], list[torch.Tensor]]


def block_hashes(prompt_ids: Sequence[int], block_size: int, images: Sequence[ImageSpan]) -> list[int]:
    """The chained hash of each full prompt block: its tokens, the previous block's hash, and the
    (content hash, first position inside the image) of each image piece in the block."""
    hashes: list[int] = []
    parent = 0
    for start in range(0, len(prompt_ids) - len(prompt_ids) % block_size, block_size):
        end = start + block_size
        extra = tuple(
            (im.key, max(start, im.offset) - im.offset) for im in images if im.offset < end and im.end > start
        )
        parent = hash((parent, tuple(prompt_ids[start:end]), extra))
        hashes.append(parent)
    return hashes


def step_images(images: Sequence[ImageSpan], start: int, end: int, first_row: int) -> list[ImageSlice]:
    """The image pieces among positions ``[start, end)`` of one sequence whose chunk begins at flat
    row ``first_row``."""
    out = []
    for image in images:
        lo, hi = max(start, image.offset), min(end, image.end)
        if lo < hi:
            out.append(ImageSlice(image, lo - image.offset, hi - image.offset, first_row + lo - start))
    return out


def embed_rows(slices: Sequence[ImageSlice], encode: Encode) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(flat rows, embeddings) that replace the step's placeholder tokens; the images not encoded
    yet go through ``encode`` together, once each."""
    if not slices:
        return None
    pending: list[ImageSpan] = []
    for piece in slices:
        if piece.image.embeds is None and all(piece.image is not p for p in pending):
            pending.append(piece.image)
    if pending:
        for image, embeds in zip(pending, encode([im.pixel_values for im in pending]), strict=True):
            image.embeds = embeds
    rows = torch.cat([torch.arange(p.row, p.row + p.hi - p.lo) for p in slices])
    values = torch.cat([p.image.embeds[p.lo : p.hi] for p in slices if p.image.embeds is not None])
    return rows, values


def release_computed(images: Sequence[ImageSpan], num_computed: int) -> None:
    """Drop the embeddings of images whose whole span is in the KV cache now."""
    for image in images:
        if image.embeds is not None and image.end <= num_computed:
            image.embeds = None
