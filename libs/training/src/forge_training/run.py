"""Job entry point: ``python -m forge_training.run --recipe NAME [--set k=v ...]``.

Every task runs through here (``pretrain``, ``cpt``, ``sft``, ``reward``, ``dpo``); a task with a
parent names it with ``--set init.parent=PATH``, which is checked (present, complete, checksums)
before anything starts.

Run directly for one process, or under ``torchrun`` (the agent's :class:`TorchrunRunner`) for
several: the rank and world size come from torchrun's environment. Each rank binds its device
first (:mod:`device`: ``cuda:LOCAL_RANK`` when the job was given GPUs, else the CPU) and the
process group's backend follows it: NCCL for GPU ranks, gloo for CPU ranks. SIGTERM (preemption) sets a flag the loop checks after every step;
the run then writes a checkpoint and exits 0. A recipe that cannot run exits 2 with the reason
before any process group is formed; a rank that runs out of GPU memory exits 3, its termination
message ``cuda out of memory: {...}`` holding :func:`device.oom_report`'s figures. The reason for a failure also goes to the agent's
termination log (``$FORGE_TERMINATION_LOG``), so the attempt's message names it rather than
torchrun's summary. Metrics go to ``<run dir>/metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
from pathlib import Path
from types import FrameType

import torch.distributed as dist

from forge_kit.jobenv import write_termination_message
from forge_kit.objectstore import ObjectStore
from forge_training import device as placement
from forge_training import recipes, schema, validation
from forge_training.train import RunContext, train

EXIT_BAD_RECIPE = 2
EXIT_OUT_OF_MEMORY = 3


def parse_overrides(pairs: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise schema.RecipeError(f"--set: expected KEY=VALUE, got {pair!r}")
        out[key] = value
    return out


_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def _run_id(value: str) -> str:
    """A run id as the object store's key names it: no separators, no parent references."""
    if value and not _RUN_ID.fullmatch(value):
        raise argparse.ArgumentTypeError(f"{value!r}: 1-128 letters, digits, '.', '_' or '-'")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="forge_training.run")
    parser.add_argument("--recipe", required=True, help=f"one of {', '.join(sorted(recipes.RECIPES))}")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe override")
    parser.add_argument("--run-dir", type=Path, default=Path(os.environ.get("FORGE_RUN_DIR", ".")))
    parser.add_argument("--run-id", default=os.environ.get("FORGE_JOB_ID", "local"))
    parser.add_argument(
        "--resume-from",
        default="",
        type=_run_id,
        help="a run id whose newest checkpoint this run starts from when it has none of its own "
        "(read only: this run checkpoints under --run-id)",
    )
    parser.add_argument(
        "--stop-after-step",
        type=int,
        default=None,
        metavar="N",
        help="leave right after step N without saving, as a crash would (checks of exact resume)",
    )
    parser.add_argument("--objects", default=os.environ.get("FORGE_OBJECTS_URL", ""), help="object store URL")
    parser.add_argument(
        "--cache-dir", type=Path, default=None, help="token shard cache (default: <run dir>/data)"
    )
    args = parser.parse_args(argv)
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    # 1. Refuse a bad recipe before anything starts.
    try:
        config = recipes.build(args.recipe, parse_overrides(args.set))
        validation.validate(config, world_size)
        device = placement.select(config.device)
    except schema.RecipeError as exc:
        print(f"recipe refused: {exc}", file=sys.stderr)
        write_termination_message(f"recipe refused: {exc}")
        return EXIT_BAD_RECIPE
    # 2. Preemption: finish the step, checkpoint, leave.
    stop = {"requested": False}

    def on_term(signum: int, frame: FrameType | None) -> None:
        stop["requested"] = True

    signal.signal(signal.SIGTERM, on_term)
    # 3. Process group (torchrun sets MASTER_ADDR/PORT).
    placement.bind(device)
    if world_size > 1:
        dist.init_process_group(
            placement.backend_for(device), device_id=device if device.type == "cuda" else None
        )
    try:
        run_dir = args.run_dir.resolve()
        store = ObjectStore(args.objects or str(run_dir / "objects"))
        ctx = RunContext(
            run_id=args.run_id,
            run_dir=run_dir,
            store=store,
            cache_dir=args.cache_dir or run_dir / "data",
            rank=rank,
            world_size=world_size,
            should_stop=lambda: stop["requested"],
            resume_from=args.resume_from or None,
            device=device,
            stop_after_step=args.stop_after_step,
        )
        try:
            result = train(config, ctx)
        except Exception as exc:
            if placement.is_out_of_memory(exc) or isinstance(exc, placement.CudaOutOfMemory):
                report = (
                    exc.report
                    if isinstance(exc, placement.CudaOutOfMemory)
                    else placement.oom_report(exc, config, device, rank, world_size)
                )
                message = json.dumps(report, separators=(",", ":"), sort_keys=True)
                print(f"cuda out of memory: {message}", file=sys.stderr, flush=True)
                write_termination_message(f"cuda out of memory: {message}")
                return EXIT_OUT_OF_MEMORY
            # The traceback goes to the log; the agent's failure message gets the reason.
            write_termination_message(f"rank {rank}: {type(exc).__name__}: {exc}")
            raise
        if rank == 0:
            summary = {
                "outcome": result.outcome,
                "step": result.step,
                "val_loss": result.val_loss,
                "val_loss_per_char": result.val_loss_per_char,
                "tokens_per_s": result.tokens_per_s,
                "mfu": result.mfu,
                "device": str(device),
                "precision": config.precision,
                "checkpoint_stalls_s": result.checkpoint_stalls_s,
                **result.memory,
                "eval": result.eval_metrics,
                "export_dir": str(result.export_dir) if result.export_dir else None,
            }
            print(json.dumps(summary), flush=True)
        return 0
    finally:
        if world_size > 1:
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
