"""Dev-only probe of what a VLM reads from an image: on fresh scenes (seed 424242, neither
training nor evaluation data) each caption is teacher-forced after its image, and the argmax
accuracy of its colour, shape, size, cell ("top"/"bottom") and count words is reported. A word
class at the share of its most frequent word means constant predictions: the image is not read.

``python -m load.vlm.caption_probe EXPORT [EXPORT ...]`` (exported VLM folders).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from forge_training.vlm import world
from forge_training.vlm.dataset import caption_sample
from forge_training.vlm.model import load_vlm
from forge_training.vlm.tokens import Encoded, SequenceEncoder, collate

PROBE_SEED = 424242
KINDS: dict[str, set[str]] = {
    "colour": set(world.COLOURS),
    "shape": set(world.SHAPES),
    "size": set(world.SIZES),
    "cell": {"top", "bottom"},
    "count": set(world.NUMBERS),
}


def _targets(enc: SequenceEncoder, encoded: Encoded, text: str) -> list[tuple[str, int]]:
    """(word class, position in ``encoded.ids``) of each probed word's first token."""
    tokens = enc.tok.encode(text, add_special_tokens=False)
    start = len(encoded.ids) - 1 - len(tokens.ids)  # the text sits between the image and EOT
    out, pos = [], 0
    for word in text.replace(",", " ").replace(".", " ").replace(":", " ").split():
        at = text.find(word, pos)
        pos = at + len(word)
        kind = next((k for k, words in KINDS.items() if word in words), None)
        if kind is None:
            continue
        for i, (a, b) in enumerate(tokens.offsets):
            if a <= at < b or a == at:
                out.append((kind, start + i))
                break
    return out


@torch.no_grad()
def probe(export: Path, scenes: int = 300, batch: int = 50) -> dict[str, float]:
    loaded = load_vlm(export)
    enc = SequenceEncoder.of(loaded, 64)
    rows, targets = [], []
    for i, scene in enumerate(world.scenes(PROBE_SEED, scenes)):
        encoded = enc.encode(caption_sample(f"p{i}", scene, loaded.spec.size), f"p{i}")
        rows.append(encoded)
        targets.append(_targets(enc, encoded, " " + world.caption(scene)))
    hits = {k: [0, 0] for k in KINDS}
    for b in range(0, len(rows), batch):
        data = collate(rows[b : b + batch], enc.eot)
        logits = loaded.model(
            input_ids=data["input_ids"],
            attention_mask=data["attention_mask"],
            pixel_values=data["pixel_values"],
        ).logits
        for r, row_targets in enumerate(targets[b : b + batch]):
            for kind, p in row_targets:
                hits[kind][0] += int(logits[r, p - 1].argmax() == data["input_ids"][r, p])
                hits[kind][1] += 1
    return {k: round(h / max(n, 1), 3) for k, (h, n) in hits.items()}


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(path, json.dumps(probe(Path(path))), flush=True)
