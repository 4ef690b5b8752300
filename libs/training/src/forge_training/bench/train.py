"""``forge bench train [--nanogpt-dir PATH] --out DIR``: the training benchmarks (quality against nanoGPT, DDP speed-up);
``forge bench recipes --out DIR``: the post-training recipes on the shared data (see
:func:`recipes_bench`). The other training benchmarks are modules of their own in this package
(see :mod:`forge_training.bench`).

Writes ``DIR/summary.json``::

    {"forge": {"val_loss_per_char", "wall_s", "tokens_per_s"},
     "nanogpt": {"val_loss_per_char", "wall_s"},          # only with --nanogpt-dir
     "ddp_speedup", "ddp_speedup_pairs", "async_checkpoint_stall_ratio",
     "fsdp": {"ddp_tokens_per_s", "fsdp_tokens_per_s", "fsdp_over_ddp"}}

1. nanoGPT (when given a checkout): its README's CPU recipe on the same corpus, timed; its
   character-level validation loss is already per character.
2. Forge: the ``shakespeare_tiny`` recipe, with ``max_steps`` calibrated so the run fits the
   same wall-clock budget (nanoGPT's time, or ``--budget-s``); per-token validation loss is
   divided by the validation split's characters per token.
3. DDP: tokens/s of 2 processes (a gloo group, gradients summed through shared memory) over 1
   process, one thread each, same global batch; the median of ``--ddp-repeats`` pairs run back
   to back (every pair's ratio is kept): single pairs range +-0.25 on these shared vCPUs.
4. Checkpoint stall: mean time the loop is blocked per save, async over sync, same run.
5. FSDP: tokens/s of 2 gloo processes with ``parallelism=fsdp`` and with ``ddp``, same recipe,
   one process group (one start-up) for both.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from forge_kit import clitools
from forge_kit.objectstore import ObjectStore
from forge_kit.paths import resolve_data_path
from forge_training import recipes, schema
from forge_training.launch import run_group, run_group_sequence
from forge_training.train import RunContext, TrainResult, pretrain
from forge_training.train import train as run_training


def _recipe(corpus: Path, **overrides: Any) -> schema.TrainConfig:
    return dataclasses.replace(recipes.build("shakespeare_tiny", {"data.corpus": str(corpus)}), **overrides)


NANOGPT_FLAGS = (
    "--device=cpu", "--compile=False", "--eval_iters=20", "--log_interval=1", "--block_size=64",
    "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128", "--max_iters=2000",
    "--lr_decay_iters=2000", "--dropout=0.0",
)  # fmt: skip
_VAL = re.compile(r"step (\d+): train loss ([0-9.]+), val loss ([0-9.]+)")


def run_nanogpt(checkout: Path, corpus: Path, work: Path) -> dict[str, float]:
    """nanoGPT's README CPU recipe, run in a copy of the checkout (its data prep writes files)."""
    if not (checkout / "train.py").is_file():
        raise typer.BadParameter(
            f"{checkout} has no train.py (not a nanoGPT checkout)", param_hint="--nanogpt-dir"
        )
    tree = work / "nanogpt"
    shutil.copytree(checkout, tree, ignore=shutil.ignore_patterns(".git"))
    data = tree / "data" / "shakespeare_char"
    shutil.copy(corpus, data / "input.txt")  # prepare.py downloads only when input.txt is missing
    subprocess.run([sys.executable, "prepare.py"], cwd=data, check=True, capture_output=True)
    started = time.perf_counter()
    out = subprocess.run(
        [
            sys.executable,
            "train.py",
            "config/train_shakespeare_char.py",
            *NANOGPT_FLAGS,
            f"--out_dir={work / 'nanogpt-out'}",
        ],
        cwd=tree,
        check=True,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - started
    evals = _VAL.findall(out.stdout)
    if not evals:
        raise RuntimeError(f"nanoGPT printed no validation loss:\n{out.stdout[-2000:]}")
    return {"val_loss_per_char": float(evals[-1][2]), "wall_s": wall}


def _ctx(root: Path, cache: Path, **kw: Any) -> RunContext:
    return RunContext(
        run_id="bench", run_dir=root, store=ObjectStore(str(root / "objects")), cache_dir=cache, **kw
    )


def steady_step_s(metrics: Path, probe: TrainResult) -> float:
    """Seconds per step of a probe run, from its last logged window of steps (its ``tokens_per_s``
    line): the first steps' one-off costs (allocation, first calls) stay out. Timed over all 20
    probe steps, they made the calibrated run use 70 s of a 105 s budget. Falls back to the whole
    run when no window was logged."""
    windows = [w for w in map(json.loads, metrics.read_text().splitlines()) if "tokens_per_s" in w]
    if not windows or not probe.step or not windows[-1]["tokens_per_s"]:
        return probe.wall_s / max(probe.step, 1)
    tokens_per_step = probe.tokens_per_s * probe.wall_s / probe.step
    return float(tokens_per_step / windows[-1]["tokens_per_s"])


def forge_quality(budget_s: float, corpus: Path, work: Path, cache: Path) -> dict[str, float]:
    """Calibrate seconds per step on 20 steps, then train for as many steps as fit the budget."""
    base = _recipe(corpus)
    probe_cfg = dataclasses.replace(base, max_steps=20, eval_interval=10**9, log_interval=10)
    probe_cfg = dataclasses.replace(probe_cfg, optim=dataclasses.replace(base.optim, warmup_steps=2))
    probe = pretrain(probe_cfg, _ctx(work / "probe", cache, export=False))
    step_s = steady_step_s(work / "probe" / "metrics.jsonl", probe)
    # Leave room for data loading, evaluations and the final checkpoint (about 15%).
    steps = max(50, int(budget_s * 0.85 / step_s))
    config = dataclasses.replace(base, max_steps=steps, eval_interval=max(1, steps // 4))
    config = dataclasses.replace(
        config, optim=dataclasses.replace(base.optim, warmup_steps=min(100, steps // 10))
    )
    started = time.perf_counter()
    result = pretrain(config, _ctx(work / "forge", cache))
    assert result.val_loss_per_char is not None
    return {
        "val_loss_per_char": result.val_loss_per_char,
        "wall_s": time.perf_counter() - started,
        "tokens_per_s": result.tokens_per_s,
        "steps": steps,
    }


def ddp_speedup(corpus: Path, work: Path, cache: Path, steps: int, repeats: int = 5) -> list[float]:
    """Tokens/s of 2 processes over 1, ``repeats`` times, the two runs of a pair back to back: on
    a shared machine one pair's ratio moves with what else is running, so the summary reports the
    median pair and keeps every pair's ratio."""
    config = _recipe(corpus, max_steps=steps, eval_interval=10**9, threads=1, micro_batch_size=6)
    config = dataclasses.replace(config, optim=dataclasses.replace(config.optim, warmup_steps=2))
    config = dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, interval_steps=0))
    ratios = []
    for i in range(repeats):
        one = run_group(config, 1, work / f"ddp1-{i}", cache_dir=cache)
        two = run_group(config, 2, work / f"ddp2-{i}", cache_dir=cache)
        ratios.append(float(two["tokens_per_s"]) / float(one["tokens_per_s"]))
    return ratios


def fsdp_vs_ddp(corpus: Path, work: Path, cache: Path, steps: int) -> dict[str, float]:
    """Tokens/s of the same 2-process run under DDP and under FSDP (the 3. config)."""
    config = _recipe(corpus, max_steps=steps, eval_interval=10**9, threads=1, micro_batch_size=6)
    config = dataclasses.replace(config, optim=dataclasses.replace(config.optim, warmup_steps=2))
    config = dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, interval_steps=0))
    modes = ("ddp", "fsdp")
    runs = [(dataclasses.replace(config, parallelism=mode), work / f"dp-{mode}") for mode in modes]
    ddp, fsdp = (float(r["tokens_per_s"]) for r in run_group_sequence(runs, 2, cache_dir=cache))
    return {"ddp_tokens_per_s": ddp, "fsdp_tokens_per_s": fsdp, "fsdp_over_ddp": fsdp / ddp}


def checkpoint_stall_ratio(corpus: Path, work: Path, cache: Path, steps: int) -> float:
    stalls: dict[bool, float] = {}
    for async_save in (False, True):
        config = _recipe(corpus, max_steps=steps, eval_interval=10**9)
        config = dataclasses.replace(config, optim=dataclasses.replace(config.optim, warmup_steps=2))
        ckpt = dataclasses.replace(
            config.checkpoint, interval_steps=max(1, steps // 5), async_save=async_save
        )
        result = pretrain(
            dataclasses.replace(config, checkpoint=ckpt),
            _ctx(work / f"ckpt-{async_save}", cache, export=False),
        )
        periodic = (
            result.checkpoint_stalls_s[:-1] or result.checkpoint_stalls_s
        )  # the last save waits by design
        stalls[async_save] = sum(periodic) / len(periodic)
    return stalls[True] / stalls[False]


def train(
    out: Annotated[Path, typer.Option(help="directory for summary.json")],
    nanogpt_dir: Annotated[Path | None, typer.Option(help="a checkout of karpathy/nanoGPT")] = None,
    budget_s: Annotated[float, typer.Option(help="wall-clock budget without nanoGPT")] = 180.0,
    corpus: Annotated[Path, typer.Option(help="training corpus")] = resolve_data_path(schema.DEFAULT_CORPUS),
    ddp_steps: Annotated[int, typer.Option(help="steps per DDP throughput run")] = 40,
    ddp_repeats: Annotated[
        int, typer.Option(min=1, help="1-process/2-process pairs; the median is reported")
    ] = 5,
    quiet: Annotated[bool, clitools.QuietOption] = False,
) -> None:
    """Run steps 1-5 of the module docstring and write DIR/summary.json."""
    if not corpus.is_file() or corpus.stat().st_size == 0:
        raise typer.BadParameter(f"{corpus} is missing or empty", param_hint="--corpus")
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {}
    with (
        tempfile.TemporaryDirectory(prefix="forge-bench-train-") as tmp,
        clitools.stages(5 if nanogpt_dir is not None else 4, quiet) as stage,
    ):
        work = Path(tmp)
        cache = work / "tokens"
        if nanogpt_dir is not None:
            stage("nanoGPT baseline")
            summary["nanogpt"] = run_nanogpt(nanogpt_dir, corpus, work)
            budget_s = summary["nanogpt"]["wall_s"]
        stage(f"Forge, {budget_s:g} s budget")
        summary["forge"] = forge_quality(budget_s, corpus, work, cache)
        if "nanogpt" in summary:
            summary["val_loss_ratio"] = (
                summary["forge"]["val_loss_per_char"] / summary["nanogpt"]["val_loss_per_char"]
            )
        stage("DDP speed-up")
        pairs = ddp_speedup(corpus, work, cache, ddp_steps, ddp_repeats)
        summary["ddp_speedup"] = statistics.median(pairs)
        summary["ddp_speedup_pairs"] = pairs
        stage("async checkpoint stall")
        summary["async_checkpoint_stall_ratio"] = checkpoint_stall_ratio(corpus, work, cache, 50)
        stage("FSDP against DDP")
        summary["fsdp"] = fsdp_vs_ddp(corpus, work, cache, ddp_steps)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    typer.echo(json.dumps(summary, indent=2))


def _run_recipe(name: str, overrides: dict[str, str], work: Path, cache: Path) -> dict[str, Any]:
    """One recipe; its figures: start (step 0) and final metrics, tokens/s, MFU, wall time."""
    config = recipes.build(name, overrides)
    started = time.perf_counter()
    result = run_training(config, _ctx(work / name, cache))
    lines = [json.loads(ln) for ln in (work / name / "metrics.jsonl").read_text().splitlines()]
    start: dict[str, Any] = next((ln for ln in lines if ln["step"] == 0), {})
    figures = [ln for ln in lines if "loss" in ln]
    out: dict[str, Any] = {
        "steps": result.step,
        "wall_s": time.perf_counter() - started,
        "tokens_per_s": result.tokens_per_s,
        "mfu": result.mfu,
        "first_loss": result.losses[min(result.losses)],
        "last_loss": result.losses[result.step],
        "start": {k: v for k, v in start.items() if k not in ("step", "time_s")},
        "final": result.eval_metrics,
        "export_dir": str(result.export_dir),
    }
    for key in (
        "general_fraction",
        "reward_margin",
        "reward_accuracy",
        "logratio_chosen",
        "logratio_rejected",
    ):
        values = [ln[key] for ln in figures if key in ln]
        if values:
            out[f"mean_{key}"] = sum(values) / len(values)
    plans = [ln for ln in lines if "checkpoint_interval_steps" in ln]
    if plans:
        out["checkpoint_plan"] = {k: v for k, v in plans[0].items() if k != "time_s"}
    return out


def recipes_bench(
    out: Annotated[Path, typer.Option(help="directory for recipes.json")],
    pretrain_steps: Annotated[int, typer.Option(help="steps of the shakespeare_tiny parent")] = 300,
    steps: Annotated[int, typer.Option(help="steps of each post-training recipe")] = 100,
    mtbf_s: Annotated[float, typer.Option(help="MTBF for the parent's Daly checkpoint interval")] = 60.0,
    quiet: Annotated[bool, clitools.QuietOption] = False,
) -> None:
    """Parent (``shakespeare_tiny``, Daly checkpoint interval) -> ``cpt_scifact``, ``sft_hh``,
    ``reward_hh`` from the parent, ``dpo_hh`` from the SFT model; writes DIR/recipes.json."""
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {}
    with (
        tempfile.TemporaryDirectory(prefix="forge-bench-recipes-") as tmp,
        clitools.stages(5, quiet) as stage,
    ):
        work, cache = Path(tmp), Path(tmp) / "tokens"
        short = {"max_steps": str(steps), "eval_interval": str(steps), "log_interval": "10",
                 "optim.warmup_steps": str(max(1, steps // 10))}  # fmt: skip
        stage("shakespeare_tiny (parent)")
        summary["pretrain"] = _run_recipe(
            "shakespeare_tiny",
            {"max_steps": str(pretrain_steps), "eval_interval": str(pretrain_steps), "log_interval": "10",
             "optim.warmup_steps": str(max(1, pretrain_steps // 10)), "checkpoint.interval_policy": "daly",
             "checkpoint.mtbf_s": str(mtbf_s), "checkpoint.interval_steps": "10"},
            work, cache,
        )  # fmt: skip
        parent = summary["pretrain"]["export_dir"]
        stage("cpt_scifact")
        summary["cpt"] = _run_recipe("cpt_scifact", {**short, "init.parent": parent}, work, cache)
        stage("sft_hh")
        summary["sft"] = _run_recipe("sft_hh", {**short, "init.parent": parent}, work, cache)
        stage("reward_hh")
        summary["reward"] = _run_recipe("reward_hh", {**short, "init.parent": parent}, work, cache)
        sft_model = summary["sft"]["export_dir"]
        stage("dpo_hh")
        summary["dpo"] = _run_recipe("dpo_hh", {**short, "init.parent": sft_model}, work, cache)
    for entry in summary.values():
        entry.pop("export_dir")
    (out / "recipes.json").write_text(json.dumps(summary, indent=2))
    typer.echo(json.dumps(summary, indent=2))
