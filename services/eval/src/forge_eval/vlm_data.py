"""The synthetic shapes world as eval-service benchmark data (``vlm_shapes/`` in the benchmarks
folder), drawn from ``forge_training.vlm.world`` — the world the VLM recipes train on — so the
eval tasks ask about the same kind of scenes, with the question templates held out of training.

Written (deterministically: the same seed gives the same files) by :func:`write_shapes`, or
``python -m forge_eval.vlm_data --out DIR`` (DIR absolute or inside ``FORGE_DATA_DIR``, by
default ``benchmarks``):

- ``vlm_shapes/vqa_heldout.jsonl``: ``{"id", "image", "question", "answer", "qtype", "template"}``
  from :func:`world.vqa_items` with ``held_out=True`` (question types in turn);
- ``vlm_shapes/captions.jsonl``: ``{"id", "image", "caption"}`` for fresh scenes;
- ``vlm_shapes/images/*.png``: each record's scene rendered at ``image_size`` pixels.

The seeds are the VLM world's evaluation seeds (``world_seed + 1_000_003`` for the questions, one
more for the captions, as ``forge_training.vlm.dataset.write_world`` draws its held-out set), so
a model trained on that world is scored on the scenes its benchmark holds out. The JSONL files
are text only and pinned in the task files; the images are hashed into each run's spec.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from forge_kit.paths import resolve_data_path

FOLDER = "vlm_shapes"
#: Default world seed of the VLM recipes, and the offset of its evaluation scenes.
WORLD_SEED = 0
EVAL_OFFSET = 1_000_003


def write_shapes(root: Path, *, world_seed: int = WORLD_SEED, count: int = 200, image_size: int = 32) -> Path:
    """Write ``root/vlm_shapes`` (over whatever is there); returns the folder."""
    from forge_training.vlm import world

    folder = root / FOLDER
    (folder / "images").mkdir(parents=True, exist_ok=True)
    seed = world_seed + EVAL_OFFSET
    vqa = []
    for i, (scene, q) in enumerate(world.vqa_items(seed, count, held_out=True, size=image_size)):
        name = f"images/vqa-{i:05d}.png"
        (folder / name).write_bytes(world.png(world.render(scene, image_size)))
        vqa.append(
            {"id": f"vqa-{i:05d}", "image": name, "question": q.question, "answer": q.answer}
            | {"qtype": q.qtype, "template": q.template}
        )
    captions = []
    for i, scene in enumerate(world.scenes(seed + 1, count)):
        name = f"images/cap-{i:05d}.png"
        (folder / name).write_bytes(world.png(world.render(scene, image_size)))
        captions.append({"id": f"cap-{i:05d}", "image": name, "caption": world.caption(scene)})
    for file, rows in (("vqa_heldout.jsonl", vqa), ("captions.jsonl", captions)):
        (folder / file).write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--out", default="benchmarks", help="benchmarks folder (absolute or in FORGE_DATA_DIR)"
    )
    parser.add_argument("--world-seed", type=int, default=WORLD_SEED)
    parser.add_argument("--count", type=int, default=200)
    args = parser.parse_args(argv)
    print(write_shapes(resolve_data_path(args.out), world_seed=args.world_seed, count=args.count))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
