"""Dev-only experiments for the VLM benchmark: train named recipe runs (each from an earlier one
of the same folder) and score each VLM on all of ``eval/val`` (dev templates; never the held-out
set), by question type.

``python -m load.vlm.dev_runs OUT SPEC``: ``SPEC`` is JSON, a list of ``[tag, recipe, overrides,
parent_tag]`` (``parent_tag`` null for the world LM); results go to ``OUT/reg.json`` and stdout.
A ``vlm_joint`` entry whose overrides hold ``"match": [tags of a chain]`` gets ``max_steps`` so
that it reads as many tokens as those runs did together, as the benchmark sizes it.
Example (the curriculum chain of RESULTS.md's run 5 dev figures)::

    python -m load.vlm.dev_runs /tmp/vlmdev '[["lm","vlm_world_lm",{},null],
        ["al","vlm_align",{},"lm"],["il","vlm_interleave",{},"al"],["in","vlm_instruct",{},"il"]]'
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from forge_training import recipes
from forge_training.bench.vlm import _run, _tokens, mean_tokens_per_step
from forge_training.objectives.vlm import world_folder
from forge_training.vlm import metrics
from forge_training.vlm.dataset import WorldSize, write_world
from forge_training.vlm.evaluate import score_chats
from forge_training.vlm.model import load_vlm
from forge_training.vlm.shards import ShardReader, shard_files
from forge_training.vlm.tokens import SequenceEncoder

SCORED = ("vlm_instruct", "vlm_joint")


def dev_eval(export: Path, folder: Path, limit: int = 400) -> dict[str, Any]:
    """Exact-match accuracy of ``export`` on ``eval/val`` (dev templates), overall and by type."""
    loaded = load_vlm(export)
    seq_len = recipes.build("vlm_instruct").data.seq_len
    enc = SequenceEncoder.of(loaded, seq_len)
    reader = ShardReader(shard_files(folder / "eval" / "val"))
    samples, _ = reader.read_many(range(min(limit, len(reader))))
    scored = score_chats(loaded.model, enc, samples)
    acc, _ = metrics.vqa_accuracy(scored.predictions, scored.references)
    return {"dev": acc, "by_type": metrics.accuracy_by(scored.groups, scored.scores)}


def main(out: Path, spec: list[list[Any]]) -> dict[str, Any]:
    work, cache = out / "work", out / "cache"
    world_cfg = recipes.build("vlm_align").vlm
    folder = world_folder(world_cfg, cache)
    write_world(folder, world_cfg.world_seed, WorldSize(image_size=world_cfg.image_size))
    reg_path = out / "reg.json"
    reg: dict[str, Any] = json.loads(reg_path.read_text()) if reg_path.exists() else {}
    for tag, name, overrides, parent in spec:
        over = {"seed": 0, **overrides}
        match = over.pop("match", None)
        if match:
            tokens = sum(reg[t]["tokens"] for t in match)
            per_step = mean_tokens_per_step(name, load_vlm(Path(reg[match[-1]]["export"])), folder)
            over["max_steps"] = math.ceil(tokens / per_step)
        if name == "vlm_world_lm":
            over.setdefault("data.corpus", str(folder / "text.txt"))
        if parent:
            over["init.parent"] = reg[parent]["export"]
        steps = int(over.get("max_steps", recipes.build(name).max_steps))
        over.setdefault("optim.warmup_steps", min(30 if name == "vlm_world_lm" else 20, steps // 4))
        result, wall = _run(name, over, work / tag, cache)
        entry: dict[str, Any] = {
            "export": str(result.export_dir),
            "wall_s": wall,
            "tokens": _tokens(result),
            "steps": result.step,
            **result.eval_metrics,
        }
        if name in SCORED and result.export_dir is not None:
            entry.update(dev_eval(result.export_dir, folder))
        reg[tag] = entry
        reg_path.write_text(json.dumps(reg, indent=1) + "\n")
        print(tag, json.dumps({k: v for k, v in entry.items() if k != "export"}), flush=True)
    return reg


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
