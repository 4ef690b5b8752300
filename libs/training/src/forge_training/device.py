"""Where a rank trains, and what the loop needs to know about that device.

**Placement** (:func:`select`). A rank trains on ``cuda:LOCAL_RANK`` when the job was given GPUs
and on the CPU otherwise. The trainer agent hands a job exactly its GPUs through
``CUDA_VISIBLE_DEVICES`` (``runner.job_environment``), so CUDA numbers them ``0..n-1`` and
torchrun's ``LOCAL_RANK`` indexes them, as torchtitan and nanoGPT bind their ranks. A job given no
GPU sees none (an empty ``CUDA_VISIBLE_DEVICES``) and stays on the CPU; so does a recipe asking for
``device=cpu`` on a GPU node. More ranks on a node than the GPUs it exposes is refused, never
doubled up or moved to the CPU behind the job's back.

**Backend** (:func:`backend_for`): NCCL for a CUDA device, gloo for a CPU one: the device decides,
never the mere presence of CUDA (NCCL collectives on CPU tensors fail).

**Batches** (:func:`pin`, :func:`to_device`): the prefetch thread copies a CUDA rank's batches
into page-locked memory; the loop then copies them with ``non_blocking=True``, so the host-to-device
copy overlaps the previous step's kernels (nanoGPT's ``pin_memory().to(device, non_blocking=True)``).
On the CPU both are the identity.

**RNG and memory** (:func:`rng_state`, :func:`memory_figures`): the device's generator state for
an exact resume, and the GPU memory high-water mark for the job's metrics.

**Out of memory** (:func:`is_out_of_memory`, :func:`oom_report`): a CUDA OOM is its own failure,
reported with the figures the planner (``forge plan``) takes: the model's shape, the batch, the
sequence length, the parallelism and the device's memory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import torch

from forge_training.schema import DEVICES, RecipeError, TrainConfig

GIB = float(1 << 30)


def local_rank(env: Mapping[str, str] = os.environ) -> int:
    """torchrun's ``LOCAL_RANK`` (0 outside torchrun)."""
    raw = env.get("LOCAL_RANK", "0")
    try:
        value = int(raw)
    except ValueError:
        raise RecipeError(f"LOCAL_RANK: expected a non-negative integer, got {raw!r}") from None
    if value < 0:
        raise RecipeError(f"LOCAL_RANK: expected a non-negative integer, got {raw!r}")
    return value


def select(want: str = "auto", env: Mapping[str, str] = os.environ) -> torch.device:
    """This rank's device (see the module docstring); ``want`` is the recipe's ``device``."""
    if want not in DEVICES:
        raise RecipeError(f"device: must be one of {', '.join(DEVICES)}, got {want!r}")
    if want == "cpu":
        return torch.device("cpu")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        if want == "cuda":
            visible = env.get("CUDA_VISIBLE_DEVICES")
            raise RecipeError(
                f"device: cuda asked for, but this rank sees no GPU (CUDA_VISIBLE_DEVICES={visible!r})"
            )
        return torch.device("cpu")
    index = local_rank(env)
    if index >= gpus:
        raise RecipeError(
            f"device: local rank {index} has no GPU of its own: {gpus} visible "
            f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')!r}); run at most {gpus} ranks per node"
        )
    return torch.device("cuda", index)


def backend_for(device: torch.device) -> str:
    """The process-group backend for ranks on ``device``."""
    return "nccl" if device.type == "cuda" else "gloo"


def bind(device: torch.device) -> None:
    """Make ``device`` this process's current CUDA device (before the process group forms, so
    NCCL's communicator and every default-device allocation land on it); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def pin(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Page-locked copies of a batch bound for a CUDA ``device`` (run in the prefetch thread);
    the batch itself for a CPU one."""
    if device.type != "cuda":
        return tensors
    return {k: v.pin_memory() for k, v in tensors.items()}


def to_device(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The batch on ``device`` (asynchronous from pinned memory; no copy when it is there)."""
    return {k: v.to(device, non_blocking=True) for k, v in tensors.items()}


def on_model_device(tensors: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The batch on the device of ``model``'s parameters (evaluation batches, made in the loop)."""
    return to_device(tensors, next(model.parameters()).device)


def rng_state(device: torch.device) -> torch.Tensor | None:
    """The generator state of this rank's CUDA device (``None`` on the CPU)."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def set_rng_state(state: torch.Tensor | None, device: torch.device) -> None:
    """Restore :func:`rng_state`'s output when the checkpoint has one and this rank is on a GPU
    (a CPU checkpoint resumed on a GPU keeps the GPU's seeded state, and the other way round)."""
    if state is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state, device)


def memory_figures(device: torch.device) -> dict[str, float]:
    """GPU memory high-water marks since the start, in GiB (nothing on the CPU)."""
    if device.type != "cuda":
        return {}
    return {
        "gpu_mem_peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
        "gpu_mem_peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB,
    }


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def is_out_of_memory(exc: BaseException) -> bool:
    """A CUDA allocation failure (``torch.OutOfMemoryError``, also raised as a plain
    ``RuntimeError`` with CUDA's message from some kernels)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "CUDA out of memory" in str(exc)


class CudaOutOfMemory(RuntimeError):
    """A rank ran out of GPU memory; :attr:`report` is :func:`oom_report`'s."""

    def __init__(self, report: dict[str, Any]) -> None:
        super().__init__(json.dumps(report, separators=(",", ":"), sort_keys=True))
        self.report = report


def _model_shape(config: TrainConfig, model_config: Any | None) -> dict[str, int]:
    """The trained model's shape: its own config (a parent's), else the recipe's ``model``."""
    if model_config is None:
        m = config.model
        return {
            "hidden_size": m.hidden_size,
            "intermediate_size": m.intermediate_size,
            "num_layers": m.num_layers,
            "num_heads": m.num_heads,
            "num_kv_heads": m.num_kv_heads,
        }
    text = getattr(model_config, "text_config", None) or model_config  # a VLM's language model
    fields = {
        "hidden_size": "hidden_size",
        "intermediate_size": "intermediate_size",
        "num_layers": "num_hidden_layers",
        "num_heads": "num_attention_heads",
        "num_kv_heads": "num_key_value_heads",
        "vocab_size": "vocab_size",
    }
    return {k: int(getattr(text, v)) for k, v in fields.items() if getattr(text, v, None) is not None}


def oom_report(
    exc: BaseException,
    config: TrainConfig,
    device: torch.device,
    rank: int,
    world_size: int,
    model_config: Any | None = None,
) -> dict[str, Any]:
    """What a CUDA OOM leaves for the planner and the operator: the device and its memory, the
    high-water marks, and the run's shape (the inputs of ``forge plan``: the model, the sequence
    length, the micro and global batch, the GPUs)."""
    report: dict[str, Any] = {
        "failure": "cuda_out_of_memory",
        "rank": rank,
        "world_size": world_size,
        "device": str(device),
        "device_name": device_name(device),
        "parallelism": config.parallelism,
        "precision": config.precision,
        "activation_checkpointing": config.activation_checkpointing,
        "micro_batch_size": config.micro_batch_size,
        "global_batch_size": config.global_batch_size,
        "grad_accum_steps": config.grad_accum_steps(world_size),
        "seq_len": config.data.seq_len,
        "model": _model_shape(config, model_config),
        "error": str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__,
    }
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        report.update(
            gpu_mem_total_gib=total / GIB,
            gpu_mem_free_gib=free / GIB,
            **memory_figures(device),
        )
    return report
