"""The few collectives the training loop needs, no-ops in a single process."""

from __future__ import annotations

import torch
import torch.distributed as dist

from forge_training.shm_allreduce import SharedMemoryAllReduce


def barrier(world_size: int) -> None:
    if world_size > 1:
        dist.barrier()


def all_reduce(
    values: list[float], world_size: int, op: str = "sum", shared: SharedMemoryAllReduce | None = None
) -> list[float]:
    """Element-wise sum (or max) of ``values`` over all ranks, in float64; a sum goes through
    ``shared`` when given (ranks on one host)."""
    if world_size == 1:
        return list(values)
    # NCCL reduces GPU tensors only: on GPU ranks the figures travel on the rank's current device.
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if shared is not None and op == "sum":
        return [float(v) for v in shared.all_reduce_(t).tolist()]
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return [float(v) for v in t.tolist()]
