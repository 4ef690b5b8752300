"""Run recipes as a local gloo process group without torchrun (tests and benchmarks).

:func:`run_group` spawns ``world_size`` processes on loopback; each trains its rank and rank 0
writes the :class:`~forge_training.train.TrainResult` figures to
``<run_dir>/result.json``, which is returned. :func:`run_group_sequence` runs several recipes
(or :class:`LocalRun` s: a shared object store, a simulated kill) one after another in the same
group, paying the process start-up once.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from forge_kit.objectstore import ObjectStore
from forge_kit.ports import free_port
from forge_training import schema, validation
from forge_training.train import RunContext, train


@dataclass(frozen=True)
class LocalRun:
    """One run of :func:`run_group_sequence`."""

    config: schema.TrainConfig
    run_dir: Path
    objects: str = ""
    """Object store URL (default ``<run_dir>/objects``); runs sharing one resume each other."""
    stop_after_step: int | None = None
    """Return right after this step without saving (a simulated kill)."""


def _worker(rank: int, world_size: int, port: int, jobs: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        for config, run in jobs:
            ctx = RunContext(
                run_id=run["run_id"],
                device=torch.device("cpu"),  # a gloo group of CPU processes
                run_dir=Path(run["run_dir"]),
                store=ObjectStore(run["objects"]),
                cache_dir=Path(run["cache_dir"]),
                rank=rank,
                world_size=world_size,
                export=run["export"],
                stop_after_step=run.get("stop_after_step"),
            )
            result = train(schema.from_dict(config), ctx)
            if rank == 0:
                out = {
                    "outcome": result.outcome,
                    "step": result.step,
                    "losses": result.losses,
                    "val_loss": result.val_loss,
                    "val_loss_per_char": result.val_loss_per_char,
                    "tokens_per_s": result.tokens_per_s,
                    "wall_s": result.wall_s,
                    "eval_metrics": result.eval_metrics,
                    "mfu": result.mfu,
                    "export_dir": str(result.export_dir) if result.export_dir else None,
                }
                (ctx.run_dir / "result.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()
    # Every run finished and its result is on disk: leave now rather than through interpreter
    # teardown, where a native thread still joinable (gloo, the prefetcher) can abort the process
    # ("terminate called without an active exception") and turn a finished group into a failed one.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_group_sequence(
    runs: Sequence[tuple[schema.TrainConfig, Path] | LocalRun],
    world_size: int,
    *,
    cache_dir: Path,
    export: bool = False,
) -> list[dict[str, Any]]:
    """Train each ``(config, run_dir)`` (objects under ``<run_dir>/objects``) or
    :class:`LocalRun` in turn on one group of ``world_size`` local processes (run id ``local``);
    rank 0's result figures of each. Every config is validated before any process starts."""
    local = [r if isinstance(r, LocalRun) else LocalRun(*r) for r in runs]
    for run in local:
        validation.validate(run.config, world_size)
    jobs = [
        (
            run.config.to_dict(),
            {
                "run_id": "local",
                "run_dir": str(run.run_dir),
                "objects": run.objects or str(run.run_dir / "objects"),
                "cache_dir": str(cache_dir),
                "export": export,
                "stop_after_step": run.stop_after_step,
            },
        )
        for run in local
    ]
    mp.spawn(_worker, args=(world_size, free_port(), jobs), nprocs=world_size)
    results = []
    for run in local:
        result: dict[str, Any] = json.loads((run.run_dir / "result.json").read_text())
        result["losses"] = {int(k): v for k, v in result["losses"].items()}
        results.append(result)
    return results


def run_group(
    config: schema.TrainConfig,
    world_size: int,
    run_dir: Path,
    *,
    cache_dir: Path,
    objects: str = "",
    run_id: str = "local",
    export: bool = False,
) -> dict[str, Any]:
    """Train ``config`` on ``world_size`` local processes; rank 0's result figures."""
    validation.validate(config, world_size)
    run = {
        "run_id": run_id,
        "run_dir": str(run_dir),
        "objects": objects or str(run_dir / "objects"),
        "cache_dir": str(cache_dir),
        "export": export,
    }
    mp.spawn(_worker, args=(world_size, free_port(), [(config.to_dict(), run)]), nprocs=world_size)
    result: dict[str, Any] = json.loads((run_dir / "result.json").read_text())
    result["losses"] = {int(k): v for k, v in result["losses"].items()}
    return result
