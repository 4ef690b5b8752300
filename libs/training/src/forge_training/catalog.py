"""The recipe catalogue: every recipe's override keys (with type and default) and the metric
names its runs emit, written to ``libs/experiments/src/forge_experiments/recipes.json``.

Other services (the orchestrator's sweeps) check a search space against that file rather than
importing this package; ``python -m forge_training.catalog --write`` regenerates it
and a test fails when it is out of date with :mod:`recipes`.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from forge_training import recipes, schema

#: Metrics every run writes per logged step (``train.py``).
STEP_METRICS = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu")
#: What each task adds: its per-step figures and its held-out evaluation (``objectives/``).
TASK_METRICS: dict[str, tuple[str, ...]] = {
    "pretrain": ("val_loss", "val_ppl"),
    "cpt": ("general_fraction", "val_loss", "val_ppl", "general_val_loss", "general_val_ppl", "forgetting"),
    "sft": ("val_loss", "val_ppl"),
    "reward": (
        "accuracy", "margin", "val_loss", "pairwise_accuracy", "pairwise_accuracy_low",
        "pairwise_accuracy_high", "val_margin", "eval_pairs",
    ),
    "dpo": (
        "reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy", "val_loss",
        "val_reward_accuracy", "val_reward_accuracy_low", "val_reward_accuracy_high", "val_reward_margin",
    ),
    "rerank": (
        "rank_accuracy", "reciprocal_rank", "val_loss", "val_rank_accuracy", "val_rank_accuracy_low",
        "val_rank_accuracy_high", "val_mrr",
    ),
    "vlm": ("val_loss", "val_ppl", "val_vqa_accuracy", "refused_items"),
}  # fmt: skip


def _leaves(prefix: str, node: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            out.update(_leaves(key + ".", value))
        else:
            out[key] = value
    return out


def catalog() -> dict[str, Any]:
    """``{recipe: {"task", "keys": {key: {"type", "default"}}, "metrics": [...]}}``: the keys are
    those :func:`recipes.build` accepts as overrides of that recipe."""
    out: dict[str, Any] = {}
    for name in sorted(recipes.RECIPES):
        config = recipes.build(name)
        keys: dict[str, Any] = {}
        for key, value in _leaves("", config).items():
            if key in ("name", "task"):
                continue
            try:
                recipes.build(name, {key: value})
            except schema.RecipeError:
                continue  # a section this task does not read
            keys[key] = {"type": type(value).__name__, "default": value}
        out[name] = {
            "task": config.task,
            "keys": keys,
            "metrics": sorted({*STEP_METRICS, *TASK_METRICS[config.task]}),
        }
    return out


def rendered() -> str:
    return json.dumps(catalog(), indent=1, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    target = Path(str(resources.files("forge_experiments").joinpath("recipes.json")))
    if args == ["--write"]:
        target.write_text(rendered())
        print(f"wrote {target}")
        return 0
    sys.stdout.write(rendered())
    return 0


if __name__ == "__main__":
    sys.exit(main())
