"""``forge bench sweep``: the sweep benchmark (:mod:`forge_training.bench.sweep`) over one space,
several (``--space FILE`` repeated), or spaces drawn from a family with a seed
(``--random-spaces N --seed S``, :func:`random_spaces`).

One space: ``DIR/summary.json`` is that space's summary (``compute_ratio``, ``regret``,
``asha.*``, ``trust``, ``per_trial`` …). Several: each space's summary goes to
``DIR/spaces/<name>/summary.json`` and ``DIR/summary.json`` holds ``spaces.<name>`` (each summary
without ``per_trial``) and ``worst``: the largest ``regret`` and ``compute_ratio`` over the spaces
and the spaces that gave them; a space's own summary is written as soon as that space is done, so
a run cut short keeps the spaces it measured. Drawn spaces are written to
``DIR/spaces/<name>.yaml`` first, so a run can be repeated space by space. Grid records
(``DIR/grid-cache``) are shared by the spaces.
"""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from forge_experiments.sweepspace import Space, from_dict, parse
from forge_kit import clitools
from forge_kit.errors import ValidationError
from forge_training import schema
from forge_training.bench.sweep import Trial, _config, benchmark

#: At most this many spaces in one run (each is a grid and a sweep of training runs).
MAX_SPACES = 64
#: The family's second factors: recipe key → the values a drawn space takes of it.
FACTORS: dict[str, list[list[Any]]] = {
    "optim.beta2": [[0.95, 0.999], [0.9, 0.99, 0.999]],
    "model.intermediate_size": [[172, 688], [172, 344, 688]],
    "model.hidden_size": [[64, 128], [64, 128, 192]],
    "model.num_layers": [[1, 4], [1, 2, 4]],
    "optim.weight_decay": [[0.0, 0.3], [0.0, 0.1, 0.3]],
}
SCHEDULES = ("cosine", "wsd")
BASE_OVERRIDES: dict[str, Any] = {
    "optim.warmup_steps": 5,
    "checkpoint.interval_steps": 0,
    "eval_batches": 8,
    "log_interval": 27,
}


def random_spaces(count: int, seed: int, max_steps: int = 243) -> list[dict[str, Any]]:
    """``count`` spaces of the family, drawn with ``seed`` (the same spaces for the same pair):
    ``shakespeare_tiny``, 12 configurations of ``max_steps`` steps, learning rate (a log range
    spanning 9 to 30 times its low end, which lies in [3e-4, 2e-3]) against one other factor
    (Adam β2, FFN width, width, depth or weight decay: 4 rates × 3 values or 6 × 2), under a
    cosine or a warmup-stable-decay schedule, early stopping with its defaults (no setting)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        low = math.exp(rng.uniform(math.log(3e-4), math.log(2e-3)))
        high = low * rng.uniform(9.0, 30.0)
        factor = rng.choice(sorted(FACTORS))
        values = rng.choice(FACTORS[factor])
        schedule = rng.choice(SCHEDULES)
        overrides = {**BASE_OVERRIDES, "optim.schedule": schedule}
        if schedule == "wsd":
            overrides["optim.decay_fraction"] = 0.2
        out.append(
            {
                "name": f"family-s{seed}-{i}",
                "recipe": "shakespeare_tiny",
                "metric": {"name": "val_loss", "mode": "min"},
                "sampler": "grid",
                "seed": rng.randrange(1000),
                "parameters": {
                    "optim.lr": {
                        "type": "loguniform",
                        "low": float(f"{low:.3g}"),
                        "high": float(f"{high:.3g}"),
                        "grid_points": 12 // len(values),
                    },
                    factor: {"type": "categorical", "values": values},
                },
                "overrides": overrides,
                "gpu_type": "SIM",
                "budget": {"trials": 12, "gpu_hours": 1, "max_steps": max_steps},
                "concurrency": 3,
                "team": "research",
                "early_stopping": {},
            }
        )
    return out


def _check(space: Space) -> None:
    """Every trial's recipe resolves (before any training)."""
    for params in space.configurations():
        for branches in (False, True):
            _config(space, Trial(0, dict(params), space.seeds[0] if space.seeds else None), branches)


def _brief(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if k != "per_trial"}


def sweep(
    out: Annotated[Path, typer.Option(help="directory for summary.json")],
    space: Annotated[
        list[Path] | None, typer.Option(help="space file (YAML, the sweep format); repeat for several")
    ] = None,
    random_count: Annotated[
        int, typer.Option("--random-spaces", help="draw this many spaces of the family (with --seed)")
    ] = 0,
    seed: Annotated[int | None, typer.Option(help="seed of the drawn spaces (alone: 10 spaces)")] = None,
    quiet: Annotated[bool, clitools.QuietOption] = False,
    fresh_grid: Annotated[
        bool, typer.Option(help="train every grid trial again (default: reuse DIR/grid-cache records)")
    ] = False,
    asha_only: Annotated[
        bool, typer.Option(help="skip the grid: no regret; compute_ratio against every trial at full budget")
    ] = False,
) -> None:
    """Grid at full budget vs early stopping (η = 3) over one or more spaces: best metric,
    trial-steps, regret, and how far the rungs could be trusted."""
    files = list(space or [])
    if seed is not None and random_count == 0:
        random_count = 10
    if random_count and seed is None:
        raise typer.BadParameter("--random-spaces needs --seed", param_hint="--random-spaces")
    if not 0 <= random_count <= MAX_SPACES or len(files) + random_count > MAX_SPACES:
        raise typer.BadParameter(f"at most {MAX_SPACES} spaces", param_hint="--space")
    if not files and not random_count:
        raise typer.BadParameter("give --space FILE or --random-spaces N --seed S", param_hint="--space")
    parsed: list[Space] = []
    drawn = random_spaces(random_count, seed or 0) if random_count else []
    try:
        for path in files:
            if not path.is_file():
                raise typer.BadParameter(f"{path} is not a file", param_hint="--space")
            parsed.append(parse(path.read_bytes()))
        parsed += [from_dict(d) for d in drawn]
        for one in parsed:
            _check(one)
    except (ValidationError, schema.RecipeError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--space") from None
    names = [p.name for p in parsed]
    if len(set(names)) != len(names):
        raise typer.BadParameter("two spaces share a name", param_hint="--space")
    out.mkdir(parents=True, exist_ok=True)
    for d in drawn:
        (out / "spaces").mkdir(exist_ok=True)
        (out / "spaces" / f"{d['name']}.yaml").write_text(yaml.safe_dump(d, sort_keys=False))
    shutil.rmtree(out / "runs", ignore_errors=True)  # a previous run's checkpoints would be resumed
    trials = sum(len(p.configurations()) * max(1, len(p.seeds)) for p in parsed)
    summaries: dict[str, dict[str, Any]] = {}
    with clitools.stages(trials if asha_only else 2 * trials, quiet) as stage:
        for one in parsed:
            work = out / "runs" / one.name if len(parsed) > 1 else out / "runs"
            grid_cache = None if fresh_grid else out / "grid-cache"
            summaries[one.name] = benchmark(
                one, work, out / "cache", echo=stage, grid_cache=grid_cache, run_grid=not asha_only
            )
            if len(parsed) > 1:
                (out / "spaces" / one.name).mkdir(parents=True, exist_ok=True)
                (out / "spaces" / one.name / "summary.json").write_text(
                    json.dumps(summaries[one.name], indent=2)
                )
    if len(parsed) == 1:
        summary = summaries[names[0]]
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        typer.echo(json.dumps(_brief(summary), indent=2))
        return
    regrets = {n: s["regret"] for n, s in summaries.items() if s["regret"] is not None}
    ratios = {n: s["compute_ratio"] for n, s in summaries.items()}
    worst_regret = max(regrets, key=lambda n: regrets[n]) if regrets else None
    worst_ratio = max(ratios, key=lambda n: ratios[n])
    summary = {
        "spaces": {n: _brief(s) for n, s in summaries.items()},
        "worst": {
            "regret": regrets[worst_regret] if worst_regret else None,
            "regret_space": worst_regret,
            "compute_ratio": ratios[worst_ratio],
            "compute_ratio_space": worst_ratio,
        },
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    typer.echo(json.dumps(summary, indent=2))
