"""``forge bench vlm --out DIR``: the three-stage curriculum against one-stage joint training
from scratch at equal total compute, on the synthetic visual world, scored on held-out question
templates (see ``load/vlm/README.md``).

1. The world (:mod:`forge_training.vlm.dataset`) is written once into ``DIR/cache``.
2. **Curriculum**: ``vlm_world_lm`` (a tiny Llama pre-trained on the world's text), then
   ``vlm_align`` -> ``vlm_interleave`` -> ``vlm_instruct``, each ``init.parent`` the previous
   run's export; every run through the ordinary loop (checkpoints, ``metrics.jsonl``).
3. **Joint**: ``vlm_joint`` (every source mixed, every weight fresh; the LM gives only the
   tokenizer and shapes) with ``max_steps`` set so that it processes as many tokens as the whole
   curriculum did, LM pre-training included (tokens = real text and image positions the model
   reads; frozen-stage tokens count in full, so joint gets at least the curriculum's FLOPs).
4. **Evaluation** of both exports on ``eval/held_out`` (held-out templates, unseen scenes; never
   used before this point): exact match with its Wilson 95 % interval, the paired difference
   (``forge_kit.stats.paired_compare``: bootstrap interval, McNemar p), the text-only control
   (the same questions without the image; ``text_only_accuracy`` is the higher of the two
   models'), and caption BLEU-4 on ``eval/captions``.

``DIR/summary.json``: ``curriculum`` and ``joint`` (``vqa_accuracy``, ``ci95``,
``caption_metric``, ``train_s``, ...), ``text_only_accuracy``, ``curriculum_vs_joint``
(``delta``, paired ``ci95``, ``p_value``), ``targets`` and the run details. Steps 2-4 run once
per training seed (``--seeds``, default ``0,1,2``; ``--seed N`` for one) and each arm's per-item
scores are averaged over the seeds before the comparison; every seed's own figures are in
``per_seed``.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from forge_kit.objectstore import ObjectStore
from forge_kit.stats import item_means, paired_compare, wilson_interval
from forge_training import recipes
from forge_training.objectives.vlm import stage_sources, world_folder
from forge_training.train import RunContext, TrainResult, train
from forge_training.vlm import metrics
from forge_training.vlm.dataset import WorldSize, write_world
from forge_training.vlm.evaluate import Scored, score_chats
from forge_training.vlm.model import LoadedVlm, load_vlm
from forge_training.vlm.shards import ShardReader, shard_files
from forge_training.vlm.tokens import SequenceEncoder

STAGES = ("vlm_align", "vlm_interleave", "vlm_instruct")


def _run(name: str, overrides: dict[str, Any], work: Path, cache: Path) -> tuple[TrainResult, float]:
    config = recipes.build(name, overrides)
    ctx = RunContext(
        run_id=name, run_dir=work / name, store=ObjectStore(str(work / "objects")), cache_dir=cache
    )
    started = time.perf_counter()
    result = train(config, ctx)
    if result.outcome != "succeeded" or result.export_dir is None:
        raise RuntimeError(f"{name}: {result.outcome} at step {result.step}")
    return result, time.perf_counter() - started


def _tokens(result: TrainResult) -> float:
    return result.tokens_per_s * result.wall_s


def _scaled(name: str, scale: float) -> int:
    return max(4, round(recipes.build(name).max_steps * scale))


def mean_tokens_per_step(name: str, loaded: LoadedVlm, folder: Path, probe: int = 200) -> float:
    """Real tokens per step of recipe ``name``'s mixture: each source's mean sequence length over
    ``probe`` evenly spread items, weighted by its share, times the global batch."""
    config = recipes.build(name)
    enc = SequenceEncoder.of(loaded, config.data.seq_len)
    per_sequence = 0.0
    for source, weight in stage_sources(config.vlm).items():
        if source == "text":
            per_sequence += weight * config.data.seq_len
            continue
        reader = ShardReader(shard_files(folder / source))
        step = max(1, len(reader) // probe)
        lengths = []
        for i in range(0, len(reader), step):
            try:
                lengths.append(min(len(enc.encode(reader.read(i), reader.name(i)).ids), config.data.seq_len))
            except ValueError:
                continue
        per_sequence += weight * sum(lengths) / max(len(lengths), 1)
    return per_sequence * config.global_batch_size


def evaluate_model(
    loaded: LoadedVlm, folder: Path, seq_len: int, limit: int = 0, max_new_tokens: int = 8
) -> dict[str, Scored]:
    enc = SequenceEncoder.of(loaded, seq_len)
    held = ShardReader(shard_files(folder / "eval" / "held_out"))
    caps = ShardReader(shard_files(folder / "eval" / "captions"))
    held_samples, bad = held.read_many(range(min(limit or len(held), len(held))))
    cap_samples, bad_caps = caps.read_many(range(min(limit or len(caps), len(caps))))
    if bad or bad_caps:
        raise RuntimeError(f"unreadable evaluation items: {[str(e) for e in bad + bad_caps]}")
    model = loaded.model
    return {
        "vqa": score_chats(model, enc, held_samples, max_new_tokens=max_new_tokens),
        "text_only": score_chats(model, enc, held_samples, with_image=False, max_new_tokens=max_new_tokens),
        "captions": score_chats(model, enc, cap_samples, captions=True, max_new_tokens=40),
    }


def _arm(scored: dict[str, Scored], train_s: float, tokens: float, steps: dict[str, int]) -> dict[str, Any]:
    vqa = scored["vqa"]
    acc, (low, high) = metrics.vqa_accuracy(vqa.predictions, vqa.references)
    text_acc, _ = metrics.vqa_accuracy(scored["text_only"].predictions, scored["text_only"].references)
    caps = scored["captions"]
    return {
        "vqa_accuracy": acc,
        "ci95": [low, high],
        "caption_metric": metrics.bleu4(caps.predictions, caps.references),
        "caption_metric_name": "BLEU-4 (corpus, one reference)",
        "train_s": train_s,
        "train_tokens": tokens,
        "steps": steps,
        "vqa_by_type": metrics.accuracy_by(vqa.groups, vqa.scores),
        "text_only_accuracy": text_acc,
        "examples": [
            {"reference": r, "prediction": p}
            for p, r in list(zip(vqa.predictions, vqa.references, strict=True))[:8]
        ],
        "caption_examples": [
            {"reference": r, "prediction": p}
            for p, r in list(zip(caps.predictions, caps.references, strict=True))[:3]
        ],
    }


@dataclass
class SeedRun:
    """One training seed's two arms: their scored evaluations and summaries."""

    seed: int
    scored: dict[str, dict[str, Scored]]
    arms: dict[str, dict[str, Any]]
    runs: dict[str, dict[str, float]]
    eval_s: float

    def summary(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            **self.arms,
            "curriculum_vs_joint": paired_compare(
                self.scored["joint"]["vqa"].scores, self.scored["curriculum"]["vqa"].scores, seed=self.seed
            ).summary(),
            "runs": self.runs,
        }


def train_seed(
    work: Path, cache: Path, scale: float, seed: int, eval_limit: int, echo: Any = print
) -> SeedRun:
    """Both arms trained with training seed ``seed`` (runs in ``work``, the world in ``cache``)
    and evaluated."""
    lm_name = "vlm_world_lm"
    world_cfg = recipes.build("vlm_align").vlm
    folder = world_folder(world_cfg, cache)
    write_world(folder, world_cfg.world_seed, WorldSize(image_size=world_cfg.image_size))
    overrides: dict[str, Any] = {"data.corpus": str(folder / "text.txt"), "seed": seed}
    steps = {lm_name: _scaled(lm_name, scale)}
    lm, lm_s = _run(
        lm_name,
        {**overrides, "max_steps": steps[lm_name], "optim.warmup_steps": min(30, steps[lm_name] // 4)},
        work,
        cache,
    )
    echo(f"seed {seed}: {lm_name}: {lm.step} steps in {lm_s:.0f}s, val_loss {lm.val_loss:.3f}")
    parent, curriculum_s, curriculum_tokens = str(lm.export_dir), lm_s, _tokens(lm)
    results: dict[str, dict[str, float]] = {lm_name: {"wall_s": lm_s, **lm.eval_metrics}}
    for name in STAGES:
        steps[name] = _scaled(name, scale)
        stage_over = {
            "init.parent": parent,
            "seed": seed,
            "max_steps": steps[name],
            "optim.warmup_steps": min(20, steps[name] // 4),
        }
        result, wall = _run(name, stage_over, work, cache)
        echo(f"seed {seed}: {name}: {result.step} steps in {wall:.0f}s, {result.eval_metrics}")
        parent, curriculum_s, curriculum_tokens = (
            str(result.export_dir),
            curriculum_s + wall,
            curriculum_tokens + _tokens(result),
        )
        results[name] = {"wall_s": wall, **result.eval_metrics}
    curriculum = load_vlm(Path(parent))
    joint_steps = math.ceil(curriculum_tokens / mean_tokens_per_step("vlm_joint", curriculum, folder))
    joint_over = {
        "init.parent": str(lm.export_dir),
        "seed": seed,
        "max_steps": joint_steps,
        "optim.warmup_steps": min(20, joint_steps // 4),
    }
    joint_result, joint_s = _run("vlm_joint", joint_over, work, cache)
    echo(f"seed {seed}: vlm_joint: {joint_result.step} steps in {joint_s:.0f}s, {joint_result.eval_metrics}")
    results["vlm_joint"] = {"wall_s": joint_s, **joint_result.eval_metrics}
    assert joint_result.export_dir is not None
    joint = load_vlm(joint_result.export_dir)
    seq_len = recipes.build("vlm_instruct").data.seq_len
    eval_start = time.perf_counter()
    scored = {
        "curriculum": evaluate_model(curriculum, folder, seq_len, eval_limit),
        "joint": evaluate_model(joint, folder, seq_len, eval_limit),
    }
    arms = {
        "curriculum": _arm(scored["curriculum"], curriculum_s, curriculum_tokens, steps),
        "joint": _arm(scored["joint"], joint_s, _tokens(joint_result), {"vlm_joint": joint_steps}),
    }
    return SeedRun(seed, scored, arms, results, time.perf_counter() - eval_start)


def _mean_arm(name: str, seeds: list[SeedRun]) -> dict[str, Any]:
    """One arm over the seeds: accuracy of the per-item mean score (its Wilson interval over the
    items, with fractional successes), mean BLEU-4 and text-only accuracy, summed time and tokens."""
    per_item = item_means([s.scored[name]["vqa"].scores for s in seeds])
    hits, n = sum(per_item), len(per_item)
    first = seeds[0].arms[name]
    return {
        **first,
        "vqa_accuracy": hits / n if n else math.nan,
        "ci95": list(wilson_interval(hits, n)),
        "caption_metric": _mean([s.arms[name]["caption_metric"] for s in seeds]),
        "train_s": sum(s.arms[name]["train_s"] for s in seeds),
        "train_tokens": sum(s.arms[name]["train_tokens"] for s in seeds),
        "steps": {str(s.seed): s.arms[name]["steps"] for s in seeds} if len(seeds) > 1 else first["steps"],
        "vqa_by_type": metrics.accuracy_by(seeds[0].scored[name]["vqa"].groups, per_item),
        "text_only_accuracy": _mean([s.arms[name]["text_only_accuracy"] for s in seeds]),
    }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def benchmark(
    out: Path, scale: float = 1.0, seeds: tuple[int, ...] = (0,), eval_limit: int = 0, echo: Any = print
) -> dict[str, Any]:
    """Train and score both arms for each training seed (one seed: runs in ``out/work``; several:
    ``out/seed-N/work`` and that seed's own ``out/seed-N/summary.json``, the world shared in
    ``out/cache``) and summarise them: with several
    seeds each arm's item scores are averaged over the seeds before the paired comparison (the
    bootstrap resamples items; the seeds' spread is in ``per_seed``)."""
    runs = []
    for seed in seeds:
        work = out / "work" if len(seeds) == 1 else out / f"seed-{seed}" / "work"
        runs.append(train_seed(work, out / "cache", scale, seed, eval_limit, echo))
        if len(seeds) > 1:  # each seed's own summary as soon as it is done
            (work.parent / "summary.json").write_text(
                json.dumps(summarise(runs[-1:], scale), indent=2) + "\n"
            )
    return summarise(runs, scale)


def summarise(runs: list[SeedRun], scale: float = 1.0) -> dict[str, Any]:
    """``summary.json`` of one or more seeds' runs (see :func:`benchmark`)."""
    seeds = [r.seed for r in runs]
    arm_c, arm_j = _mean_arm("curriculum", runs), _mean_arm("joint", runs)
    curriculum_vs_joint = paired_compare(
        item_means([r.scored["joint"]["vqa"].scores for r in runs]),
        item_means([r.scored["curriculum"]["vqa"].scores for r in runs]),
        seed=seeds[0],
    ).summary()
    text_only = max(arm_c["text_only_accuracy"], arm_j["text_only_accuracy"])
    return {
        "curriculum": arm_c,
        "joint": arm_j,
        "text_only_accuracy": text_only,
        "curriculum_vs_joint": curriculum_vs_joint,
        "targets": {
            "curriculum_beats_joint": curriculum_vs_joint["ci95"][0] > 0,
            "both_beat_text_only_by_20_points": min(arm_c["vqa_accuracy"], arm_j["vqa_accuracy"]) - text_only
            >= 0.20,
        },
        "compute": {
            "unit": "real tokens processed (text + image positions), frozen stages counted in full",
            "curriculum_tokens": arm_c["train_tokens"],
            "joint_tokens": arm_j["train_tokens"],
        },
        "per_seed": [r.summary() for r in runs] if len(runs) > 1 else [],
        "runs": runs[0].runs if len(runs) == 1 else {str(r.seed): r.runs for r in runs},
        "eval_s": sum(r.eval_s for r in runs),
        "eval_items": len(runs[0].scored["curriculum"]["vqa"].scores),
        "scale": scale,
        "seed": seeds[0],
        "seeds": list(seeds),
        "load_average": list(os.getloadavg()),
        "cpus": os.cpu_count(),
    }


#: The benchmark's reading: one seed alone is a lottery at this scale (load/vlm/RESULTS.md).
DEFAULT_SEEDS = "0,1,2"


def vlm(
    out: Annotated[Path, typer.Option("--out", help="Folder for summary.json, the runs and the world")],
    scale: Annotated[float, typer.Option(help="Multiply every recipe's max_steps (1: the benchmark)")] = 1.0,
    seed: Annotated[
        int | None, typer.Option(help="One training seed for every run (instead of --seeds)")
    ] = None,
    seeds: Annotated[
        str,
        typer.Option(
            help="Training seeds, comma-separated: each arm trained once per seed, averaged over them"
        ),
    ] = DEFAULT_SEEDS,
    eval_limit: Annotated[int, typer.Option(help="Score only the first N evaluation items (0: all)")] = 0,
) -> None:
    """Curriculum (LM -> align -> interleave -> instruct) against joint training at equal compute."""
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    chosen = (seed,) if seed is not None else tuple(int(x) for x in seeds.split(",") if x.strip())
    if not chosen:
        raise typer.BadParameter("give at least one training seed", param_hint="--seeds")
    summary = benchmark(out, scale, chosen, eval_limit, echo=typer.echo)
    summary["total_s"] = time.perf_counter() - started
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    keys = ("vqa_accuracy", "ci95", "caption_metric", "train_s")
    typer.echo(
        json.dumps(
            {k: summary[k] for k in ("text_only_accuracy", "curriculum_vs_joint", "targets")}, indent=2
        )
    )
    typer.echo(
        json.dumps({arm: {k: summary[arm][k] for k in keys} for arm in ("curriculum", "joint")}, indent=2)
    )
