"""``forge bench cpt --out DIR``: the continual pre-training workflow's search and selection,
in-process and small: the mixture curve (domain and general loss against the replay fraction,
with paired intervals) and the chosen checkpoint.

Steps (the ``cpt`` workflow's, with the eval service replaced by per-window losses computed here):

1. **Parent**: the tiny pre-training recipe (``shakespeare_tiny``) for ``--parent-steps`` (or
   ``--parent DIR``, a Hugging Face folder).
2. **Mixture search**: for each replay fraction, the peak LRs as a sweep
   (:func:`forge_experiments.cptmix.sweep_space`, checked by :mod:`forge_experiments.sweepspace` as the workflow's
   are) of ``cpt_scifact`` runs of ``--search-steps`` steps, LR re-warmed over
   ``--warmup-fraction`` of the run and re-decayed (cosine) to ``--min-lr``, run one after another
   (:func:`forge_training.bench.sweep.run_trial`) under ASHA's stopping form
   (:class:`forge_experiments.earlystop.Asha`, η = 3, first rung at a third of the budget) on the domain
   ``val_loss``.
3. **Measurement**: the base and every search run that reached the budget are scored on the same
   ``--windows`` held-out windows of the domain corpus (SciFact) and of the general corpus
   (Shakespeare), each window's mean next-token loss in nats; forgetting and domain gain get the
   95 % paired-bootstrap interval of the per-window differences (:func:`forge_experiments.cptmix.paired_point`).
4. **Mixture choice**: the rule (:class:`forge_experiments.cptmix.Rule`: ``--max-forgetting``,
   ``--bound``) over the search points; no admissible point ends the run there
   (``outcome: none_admissible``, with the reason).
5. **Final run** at the chosen mixture for ``--final-steps``, a checkpoint every third of it; each
   is measured as in 3.
6. **Checkpoint choice**: the same rule over every measured checkpoint (search and final) on the
   domain-gain / forgetting Pareto front.

Writes ``DIR/summary.json`` (``base``, ``rule``, ``curve`` rows ``{label, stage, general_fraction,
lr, steps, domain_loss, domain_ci95, general_loss, general_ci95, domain_gain, domain_gain_ci95,
forgetting, forgetting_ci95, n_domain, n_general, admissible, on_front, chosen}``, ``front``,
``chosen``, ``outcome``, ``reason``, ``mixture`` (the search's choice), ``search``, ``final``,
``wall_s``, ``command``), ``DIR/mixture.md`` and ``DIR/mixture.png``.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import torch
import torch.nn.functional as F
import typer

from forge_experiments import cptmix, cptreport, sweepspace
from forge_experiments.earlystop import Asha
from forge_kit import clitools
from forge_kit.errors import ValidationError
from forge_kit.objectstore import ObjectStore
from forge_training import recipes, schema
from forge_training.bench.sweep import Trial, run_trial
from forge_training.checkpoint import CheckpointManager
from forge_training.data import TokenShards, prepare
from forge_training.objectives.base import spread
from forge_training.parents import load_parent
from forge_training.train import RunContext, pretrain

RECIPE = "cpt_scifact"
ETA = 3
_BATCH = 32


def _floats(text: str, option: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter(
            f"must be comma-separated numbers, got {text!r}", param_hint=option
        ) from None


class Scorer:
    """Per-window mean next-token loss (nats) of a model on fixed held-out windows of the domain
    and general corpora, tokenised with the parent's tokenizer (as the ``cpt`` task reads them)."""

    def __init__(self, config: schema.TrainConfig, tokenizer_json: str, cache: Path, windows: int) -> None:
        general_cfg = dataclasses.replace(config.data, corpus=config.mixture.general_corpus)
        self.seq_len = config.data.seq_len
        self.splits: dict[str, TokenShards] = {
            "domain": prepare(config.data, cache, tokenizer_json).split("val"),
            "general": prepare(general_cfg, cache, tokenizer_json).split("val"),
        }
        self.windows = {k: spread(s.num_windows(self.seq_len), windows) for k, s in self.splits.items()}

    @torch.no_grad()
    def losses(self, model: torch.nn.Module, suite: str) -> list[float]:
        split, out = self.splits[suite], []
        model.eval()
        ids = self.windows[suite]
        for start in range(0, len(ids), _BATCH):
            rows = torch.from_numpy(
                np.stack([split.window(i, self.seq_len) for i in ids[start : start + _BATCH]])
            )
            logits = model(input_ids=rows[:, :-1], use_cache=False).logits
            loss = F.cross_entropy(logits.transpose(1, 2), rows[:, 1:], reduction="none").mean(dim=1)
            out += [float(x) for x in loss]
        return out

    def score(self, ref: str) -> dict[str, list[float]]:
        model = load_parent(ref).model
        return {suite: self.losses(model, suite) for suite in self.splits}


def manifests(run_dir: Path, run_id: str) -> list[str]:
    """Paths of a bench run's complete checkpoint manifests, oldest first."""
    store = ObjectStore(str(run_dir / "objects"))
    manager = CheckpointManager(store, run_id, async_save=False)
    steps = sorted({int(k.split("/step-")[1][:8]) for k in store.list(manager.prefix) if "/step-" in k})
    return [store.url(manager.read_manifest(s).key) for s in steps]


def _point(
    label: str,
    f: float,
    lr: float,
    steps: int,
    base: dict[str, list[float]],
    got: dict[str, list[float]],
    stage: str,
    uri: str,
) -> cptmix.Point:
    return cptmix.paired_point(
        label,
        f,
        lr,
        steps,
        base_domain=base["domain"],
        domain=got["domain"],
        base_general=base["general"],
        general=got["general"],
        stage=stage,
        uri=uri,
    )


def benchmark(
    parent: str,
    search: cptmix.SearchSpace,
    rule: cptmix.Rule,
    *,
    search_steps: int,
    final_steps: int,
    windows: int,
    fixed: dict[str, Any],
    work: Path,
    cache: Path,
    echo: Any = print,
) -> dict[str, Any]:
    """Steps 2-6 of the module docstring from the parent ``parent``; the summary."""
    started = time.perf_counter()
    base_cfg = recipes.build(RECIPE, {**fixed, "init.parent": parent})
    scorer = Scorer(base_cfg, load_parent(parent).tokenizer_json, cache, windows)
    base = scorer.score(parent)
    base_row = {
        "label": "base",
        "uri": parent,
        "domain_loss": float(np.mean(base["domain"])),
        "general_loss": float(np.mean(base["general"])),
        "windows": windows,
    }
    # 2-3. The mixture search, one sweep per replay fraction, and its measurement.
    points: list[cptmix.Point] = []
    trials_out: list[dict[str, Any]] = []
    min_steps = max(1, search_steps // ETA)
    for fi, fraction in enumerate(search.general_fractions):
        space = sweepspace.from_dict(
            cptmix.sweep_space(
                search,
                fraction,
                name=f"cpt-bench-f{fi}",
                recipe=RECIPE,
                steps=search_steps,
                fixed={**fixed, "init.parent": parent, "eval_interval": min_steps},
                early_stopping={"rule": "asha", "min_steps": min_steps, "eta": ETA, "form": "stopping"},
                team="bench",
                concurrency=1,
                gpu_hours=1.0,
            )
        )
        rule_es = Asha(min_steps=min_steps, eta=ETA, max_steps=search_steps, mode="min")
        for li, params in enumerate(space.configurations()):
            index = fi * len(search.peak_lrs) + li
            trial = Trial(index, dict(params), None)
            echo(f"search: replay {fraction:g}, peak LR {params['optim.lr']:g}")

            def judge(step: int, value: float | None, i: int = index, es: Asha = rule_es) -> bool:
                if value is None:  # an evaluation no rung judges
                    return True
                return step >= search_steps or es.report(str(i), step, value) != "stop"

            run_trial(space, trial, work / "search", cache, judge)
            row = {
                "trial": index,
                "general_fraction": fraction,
                "lr": params["optim.lr"],
                "steps": trial.steps,
                "val_loss": trial.final,
                "stopped_at": trial.stopped_at,
                "curve": trial.curve,
            }
            trials_out.append(row)
            if trial.final is None:
                continue
            uri = manifests(work / "search" / f"t{index:03d}", f"t{index}")[-1]
            lr = float(params["optim.lr"])
            label = f"search f={fraction:g} lr={lr:g}"
            points.append(_point(label, fraction, lr, trial.steps, base, scorer.score(uri), "search", uri))
    # 4. The mixture.
    mixture = cptmix.select(points, rule)
    out: dict[str, Any] = {"search": {"steps": search_steps, "trials": trials_out}}
    out["mixture"] = {"reason": mixture.reason}
    if mixture.chosen is not None:
        best = points[mixture.chosen]
        out["mixture"].update(general_fraction=best.general_fraction, lr=best.lr)
        # 5. The final run, a checkpoint every third of it.
        echo(f"final: replay {best.general_fraction:g}, peak LR {best.lr:g}, {final_steps} steps")
        overrides = {
            **fixed,
            **search.overrides(final_steps),
            **search.run_overrides(best.general_fraction, best.lr),
            "init.parent": parent,
            "max_steps": final_steps,
            "eval_interval": max(1, final_steps // 3),
            "checkpoint.interval_steps": max(1, final_steps // 3),
            "checkpoint.keep_last": 4,
        }
        config = recipes.build(RECIPE, overrides)
        run_dir = work / "final"
        ctx = RunContext(
            run_id="final",
            run_dir=run_dir,
            store=ObjectStore(str(run_dir / "objects")),
            cache_dir=cache,
            export=False,
        )
        from forge_training.train import train as run_training

        result = run_training(config, ctx)
        out["final"] = {
            "steps": result.step,
            "outcome": result.outcome,
            "general_fraction": best.general_fraction,
            "lr": best.lr,
            "wall_s": round(result.wall_s, 1),
        }
        for uri in manifests(run_dir, "final"):
            step = int(uri.split("/step-")[1][:8])
            label = f"final step {step}"
            points.append(
                _point(label, best.general_fraction, best.lr, step, base, scorer.score(uri), "final", uri)
            )
    # 6. The checkpoint.
    return cptmix.summary(
        points,
        rule,
        base_row,
        name="forge bench cpt",
        units="nats per token",
        search_space={
            "general_fractions": list(search.general_fractions),
            "peak_lrs": list(search.peak_lrs),
            "warmup_fraction": search.warmup_fraction,
            "min_lr": search.min_lr,
            "schedule": search.schedule,
        },
        wall_s=round(time.perf_counter() - started, 1),
        **out,
    )


def cpt(
    out: Annotated[Path, typer.Option(help="directory for summary.json, mixture.md, mixture.png")],
    parent: Annotated[str, typer.Option(help="parent Hugging Face folder (empty: pre-train one)")] = "",
    parent_steps: Annotated[int, typer.Option(help="steps of the shakespeare_tiny parent")] = 400,
    fractions: Annotated[str, typer.Option(help="replay fractions to search")] = "0.05,0.25,0.5,0.75",
    lrs: Annotated[str, typer.Option(help="peak learning rates to search")] = "1e-3,3e-3",
    warmup_fraction: Annotated[float, typer.Option(help="re-warm share of each run")] = 0.1,
    min_lr: Annotated[float, typer.Option(help="re-decay floor")] = 1e-4,
    search_steps: Annotated[int, typer.Option(help="steps of each search run")] = 90,
    final_steps: Annotated[int, typer.Option(help="steps of the final run")] = 270,
    windows: Annotated[int, typer.Option(help="held-out windows per suite")] = 256,
    max_forgetting: Annotated[float, typer.Option(help="rule: most forgetting (nats)")] = 0.1,
    min_domain_gain: Annotated[float, typer.Option(help="rule: least domain gain (nats)")] = 0.0,
    bound: Annotated[str, typer.Option(help="rule: interval | point")] = "interval",
    quiet: Annotated[bool, clitools.QuietOption] = False,
) -> None:
    """Continual pre-training: mixture search as sweeps with ASHA, paired forgetting and domain
    gain against the parent, the rule's mixture and checkpoint; DIR/summary.json, mixture.md/.png."""
    try:
        search = cptmix.SearchSpace(
            _floats(fractions, "--fractions"), _floats(lrs, "--lrs"), warmup_fraction, min_lr
        ).validate("search")
        rule = cptmix.Rule(max_forgetting, min_domain_gain, bound).validate("rule")
    except ValidationError as exc:
        raise typer.BadParameter(str(exc)) from None
    for name, value in (
        ("--search-steps", search_steps),
        ("--final-steps", final_steps),
        ("--windows", windows),
    ):
        if not 3 <= value <= 100_000:
            raise typer.BadParameter("must be between 3 and 100000", param_hint=name)
    out.mkdir(parents=True, exist_ok=True)
    work, cache = out / "runs", out / "cache"
    shutil.rmtree(work, ignore_errors=True)  # a previous run's checkpoints would be resumed
    fixed: dict[str, Any] = {"eval_batches": 8, "log_interval": 10, "checkpoint.interval_steps": 0}
    started = time.perf_counter()
    stages = 2 + len(search.grid()) + 1
    with clitools.stages(stages, quiet) as stage:
        if not parent:
            stage(f"parent: shakespeare_tiny, {parent_steps} steps")
            config = recipes.build(
                "shakespeare_tiny",
                {
                    "max_steps": parent_steps,
                    "eval_interval": parent_steps,
                    "optim.warmup_steps": max(1, parent_steps // 10),
                },
            )
            pdir = work / "parent"
            ctx = RunContext(
                run_id="parent", run_dir=pdir, store=ObjectStore(str(pdir / "objects")), cache_dir=cache
            )
            result = pretrain(config, ctx)
            if result.export_dir is None:
                raise RuntimeError("the parent run exported no model")
            parent = str(result.export_dir)
        summary = benchmark(
            parent,
            search,
            rule,
            search_steps=search_steps,
            final_steps=final_steps,
            windows=windows,
            fixed=fixed,
            work=work,
            cache=cache,
            echo=stage,
        )
    summary["total_wall_s"] = round(time.perf_counter() - started, 1)
    summary["command"] = (
        " ".join(["forge bench cpt", *sys.argv[2:]]) if len(sys.argv) > 1 else "forge bench cpt"
    )
    summary["date"] = time.strftime("%Y-%m-%d", time.gmtime())
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    cptreport.write(summary, out)
    brief = {k: summary[k] for k in ("outcome", "reason", "mixture", "front", "total_wall_s")}
    typer.echo(json.dumps(brief, indent=2))
