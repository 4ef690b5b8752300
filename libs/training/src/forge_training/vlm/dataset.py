"""The synthetic world written as training data: WebDataset shards per kind, the world's plain
text for pre-training the language model, and the evaluation sets.

Layout of :func:`write_world`'s output folder (every part a pure function of the seed)::

    captions/    caption samples: [image, " " + caption]                    (stage 1)
    documents/   interleaved documents of 2-3 scenes                         (stage 2)
    chats/       VQA chats on train templates + "Describe the picture."     (stage 3)
    text.txt     the world's plain text (captions, descriptions, train-template Q&A)
    eval/val/        chats on dev templates (train-side wordings never trained on), unseen scenes
                     (model selection; never held-out data)
    eval/held_out/   chats on held-out templates, unseen scenes (the benchmark's VQA set)
    eval/captions/   caption chats on unseen scenes (the caption metric)
    world.json   what was written (seed, generator version, counts, image size) and a content hash

Training scenes come from ``seed``; evaluation scenes from different seeds, so no evaluated
scene is trained on.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from forge_training.vlm import world
from forge_training.vlm.shards import Sample, ShardWriter


@dataclass(frozen=True)
class WorldSize:
    captions: int = 4000
    documents: int = 1500
    chats: int = 4000
    text_scenes: int = 4000
    eval_items: int = 400
    image_size: int = 32
    per_shard: int = 1000


def caption_sample(key: str, scene: world.Scene, size: int) -> Sample:
    image = world.png(world.render(scene, size))
    return Sample(
        key, "caption", segments=[{"image": 0}, {"text": " " + world.caption(scene)}], images=[image]
    )


def chat_sample(
    key: str, scene: world.Scene, text: str, answer: str, size: int, meta: dict[str, str]
) -> Sample:
    image = world.png(world.render(scene, size))
    return Sample(key, "chat", messages=world.chat(text, answer), images=[image], meta=meta)


def _hash(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.name != "world.json":
            digest.update(path.relative_to(folder).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def write_world(out: Path, seed: int, size: WorldSize) -> dict[str, object]:
    """Write the world to ``out`` (skipped when ``out/world.json`` already records the same seed
    and sizes); returns the ``world.json`` record."""
    record: dict[str, object] = {"seed": seed, "version": world.VERSION, **asdict(size)}
    marker = out / "world.json"
    if marker.is_file():
        existing = json.loads(marker.read_text())
        if {k: existing.get(k) for k in record} == record:
            return dict(existing)
    px, per = size.image_size, size.per_shard
    with ShardWriter(out / "captions", "captions", per) as w:
        for i, scene in enumerate(world.scenes(seed, size.captions)):
            w.write(caption_sample(f"c{i:07d}", scene, px))
    rng = np.random.default_rng([seed, 0xD0C])
    with ShardWriter(out / "documents", "documents", per) as w:
        pool = world.scenes(seed + 1, size.documents * 3)
        for i in range(size.documents):
            group = pool[3 * i : 3 * i + int(rng.integers(2, 4))]
            images = [world.png(world.render(s, px)) for s in group]
            w.write(Sample(f"d{i:07d}", "document", segments=world.document(group), images=images))
    with ShardWriter(out / "chats", "chats", per) as w:
        describe = size.chats // 5
        for i, (scene, q) in enumerate(world.vqa_items(seed + 2, size.chats - describe, held_out=False)):
            w.write(
                chat_sample(
                    f"q{i:07d}", scene, q.question, q.answer, px, {"qtype": q.qtype, "template": q.template}
                )
            )
        for i, scene in enumerate(world.scenes(seed + 3, describe)):
            meta = {"qtype": "caption", "template": world.DESCRIBE}
            w.write(chat_sample(f"k{i:07d}", scene, world.DESCRIBE, world.caption(scene), px, meta))
    (out / "text.txt").write_text(world.world_text(seed + 4, size.text_scenes), encoding="utf-8")
    eval_seed = seed + 1_000_003
    for name, held_out in (("val", False), ("held_out", True)):
        items = world.vqa_items(eval_seed, size.eval_items, held_out=held_out, dev=not held_out)
        with ShardWriter(out / "eval" / name, name, per) as w:
            for i, (scene, q) in enumerate(items):
                meta = {"qtype": q.qtype, "template": q.template}
                w.write(chat_sample(f"e{i:07d}", scene, q.question, q.answer, px, meta))
    with ShardWriter(out / "eval" / "captions", "captions", per) as w:
        for i, scene in enumerate(world.scenes(eval_seed + 1, size.eval_items)):
            meta = {"qtype": "caption", "template": world.DESCRIBE}
            w.write(chat_sample(f"e{i:07d}", scene, world.DESCRIBE, world.caption(scene), px, meta))
    record["hash"] = _hash(out)
    marker.write_text(json.dumps(record, indent=2) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    """``python -m forge_training.vlm.dataset OUT [--seed N]``: write the synthetic world."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--image-size", type=int, default=32)
    args = parser.parse_args(argv)
    print(json.dumps(write_world(args.out, args.seed, WorldSize(image_size=args.image_size)), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
