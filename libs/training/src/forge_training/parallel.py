"""Data parallelism over the ranks: what the loop does differently under DDP and under FSDP.

``ddp``: every rank holds the whole model; :class:`~torch.nn.parallel.DistributedDataParallel`
all-reduces gradients. ``fsdp``: FSDP2's ``fully_shard`` on each transformer block (a decoder's
or an encoder's), then on the root, so parameters, gradients and AdamW state are DTensors sharded
over the ranks; every forward all-gathers a layer's parameters and every backward reduce-scatters
its gradients. One process trains the plain module either way.

Checkpoints hold the *full* state whichever the mode (rank 0's shard, as under DDP): under FSDP it is
gathered with ``torch.distributed.checkpoint.state_dict`` (``full_state_dict=True,
cpu_offload=True``) and each rank takes its slice back on load. That keeps one checkpoint format
for both modes, so a run may resume on any number of ranks (elastic) and in either mode, and
``init.parent`` and the Hugging Face export read it unchanged. The price is that rank 0 holds one
full copy of model and optimizer state in CPU memory while saving, which is nothing for these
models; past a few billion parameters per node the per-rank DCP format would be the choice.

The optimizer state is stored keyed by parameter index under DDP (``optimizer.state_dict()``) and
by parameter name under FSDP (DCP's full optimizer state dict); :func:`load_state` converts
between the two.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from transformers import PreTrainedModel

from forge_training.shm_allreduce import SharedMemoryAllReduce

_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
_SCATTER = StateDictOptions(full_state_dict=True)


def shard(
    model: PreTrainedModel, parallelism: str, world_size: int, device: torch.device | None = None
) -> bool:
    """Apply ``fully_shard`` to every transformer block (a decoder's ``layers``, an encoder's
    ``encoder.layer``) and then the root when ``parallelism`` is ``fsdp`` on several ranks (in
    place: the model's class becomes ``FSDP<class>``); whether it did. The mesh is one dimension
    over the ranks on ``device``'s type (default: the CPU), and ``fully_shard`` moves each rank's
    shards there, so a GPU rank never holds more than its shards on the GPU. Call before the
    optimizer is built: it must hold the sharded parameters."""
    if parallelism != "fsdp" or world_size == 1:
        return False
    mesh = init_device_mesh((device or torch.device("cpu")).type, (world_size,))
    for layer in transformer_blocks(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return True


def transformer_blocks(model: PreTrainedModel) -> torch.nn.ModuleList:
    """The model's stack of transformer blocks, FSDP's unit of sharding."""
    base = model.base_model
    encoder = getattr(base, "encoder", None)
    for blocks in (getattr(base, "layers", None), getattr(encoder, "layer", None)):
        if isinstance(blocks, torch.nn.ModuleList) and len(blocks):
            return blocks
    raise ValueError(
        f"parallelism: fsdp needs a stack of transformer blocks, {type(model).__name__} has none"
    )


def replicate(
    model: torch.nn.Module,
    sharded: bool,
    world_size: int,
    shared: SharedMemoryAllReduce | None = None,
) -> torch.nn.Module:
    """The module the loop trains through: DDP around ``model`` on several ranks unless it is
    sharded (FSDP syncs gradients itself). With ``shared``, DDP all-reduces the gradients
    through it (CPU ranks on one host) instead of the backend; the averaged gradients are the same."""
    if world_size == 1 or sharded:
        return model
    device = next(model.parameters()).device
    ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    if shared is not None:
        ddp.register_comm_hook(None, shared.ddp_hook)
    return ddp


@contextmanager
def gradient_sync(module: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """Accumulate gradients locally (no all-reduce / reduce-scatter) unless ``enabled``; the
    micro-batch that syncs carries the accumulated gradients with it."""
    if enabled:
        yield
    elif isinstance(module, DistributedDataParallel):
        with module.no_sync():
            yield
    elif isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
    else:
        yield


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float, scale: float = 1.0) -> float:
    """Multiply the gradients by ``scale``, clip them to ``max_norm`` (0: no clipping) and return
    the global norm of the scaled gradients before clipping, in one pass over the gradients (the
    scale and the clipping coefficient are one factor). With sharded (DTensor) gradients torch
    computes the norm of each shard and all-reduces it; every rank returns the same figure."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    total = torch.nn.utils.get_total_norm(grads)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    norm = float(total) * scale
    factor = scale * min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 else scale
    if factor != 1.0:
        for g in grads:
            g.mul_(factor)
    return norm


def full_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, sharded: bool, rank: int
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """Model and optimizer state for rank 0's checkpoint shard; ``None`` on the other ranks.
    Sharded, every rank must call it (it all-gathers)."""
    if sharded:
        model_state = get_model_state_dict(model, options=_GATHER)
        optim_state = get_optimizer_state_dict(model, optimizer, options=_GATHER)
        return (model_state, optim_state) if rank == 0 else None
    if rank != 0:
        return None
    return model.state_dict(), optimizer.state_dict()


def load_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    model_state: dict[str, Any],
    optim_state: dict[str, Any],
    sharded: bool,
) -> None:
    """Load a checkpoint's full state (written in either mode) into this rank's model and
    optimizer; sharded, every rank calls it with the full state and keeps its own slice."""
    names = _group_names(model, optimizer)
    if sharded:
        set_model_state_dict(model, model_state, options=_SCATTER)
        set_optimizer_state_dict(model, optimizer, _by_name(optim_state, names), options=_SCATTER)
    else:
        model.load_state_dict(model_state)
        optimizer.load_state_dict(_by_index(optim_state, names))


def full_model(
    model: PreTrainedModel, plain: type[PreTrainedModel], sharded: bool, rank: int
) -> PreTrainedModel | None:
    """An unsharded ``plain`` copy of ``model`` on rank 0 for export (``None`` elsewhere);
    ``model`` itself when it is not sharded. Sharded, every rank must call it (it all-gathers)."""
    if not sharded:
        return model if rank == 0 else None
    state = get_model_state_dict(model, options=_GATHER)
    if rank != 0:
        return None
    copy = plain(model.config)
    copy.load_state_dict(state)
    copy.train(model.training)
    return copy


def _group_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Parameter names of each optimizer group, in the group's order."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [[name_of[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def _keyed_by_name(state: dict[str, Any]) -> bool:
    return any(isinstance(p, str) for group in state["param_groups"] for p in group["params"])


def _by_name(state: dict[str, Any], names: list[list[str]]) -> dict[str, Any]:
    """An index-keyed (``optimizer.state_dict()``) state keyed by parameter name instead."""
    flat = [n for group in names for n in group]
    if _keyed_by_name(state):
        return state
    return {
        "state": {flat[int(k)]: v for k, v in state["state"].items()},
        "param_groups": [{**g, "params": [flat[int(i)] for i in g["params"]]} for g in state["param_groups"]],
    }


def _by_index(state: dict[str, Any], names: list[list[str]]) -> dict[str, Any]:
    """A name-keyed (DCP) optimizer state keyed by parameter index, as ``load_state_dict`` takes."""
    index = {n: i for i, n in enumerate(n for group in names for n in group)}
    if not _keyed_by_name(state):
        return state
    return {
        "state": {index[cast(str, k)]: v for k, v in state["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]],
    }
