"""Model FLOPs utilisation: model FLOPs per second over the device's peak.

Per token, training costs ``6 N + 12 L d T`` FLOPs (PaLM, appendix B; nanoGPT's
``estimate_mfu``): ``N`` the parameters that multiply (every projection and the LM or score head;
the embedding is a lookup), 2 FLOPs per multiply-add forward and twice that backward, plus the
attention scores and their weighted sum, ``2 x 2 d T`` per layer forward (non-causal convention,
as PaLM and Megatron count it). A forward-only pass (DPO's reference model) is a third of that.

The peak is per process: a configured figure, else the dense bf16 peak of a known GPU (an unknown
part gets no MFU rather than a guessed one), else on CPU ``cpu_peak_flops_per_thread`` x torch's
intra-op threads (see :class:`schema.MetricsConfig`).
"""

from __future__ import annotations

import re

import torch
from transformers import PreTrainedConfig

from forge_training.schema import MetricsConfig

#: Dense bf16 peak FLOP/s by the name CUDA reports (vendor data sheets, without sparsity, as
#: torchtitan tabulates them); the more specific names come first. ``NVIDIA H100 80GB HBM3`` is the
#: SXM part, ``NVIDIA H100 PCIe`` the PCIe card; the A100's 40 and 80 GB parts have one peak.
GPU_PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989e12),
    ("H200 NVL", 835e12),
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("L4", 121e12),
    ("RTX 6000 Ada", 364e12),
    ("RTX A6000", 155e12),
)


def _shape(config: PreTrainedConfig) -> tuple[int, int, int, int, int, int]:
    """(hidden, layers, heads, kv heads, head dim, intermediate) of a Llama-style config (a BERT
    config has as many key/value heads as query heads)."""
    h, heads = int(config.hidden_size), int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or h // heads)
    return (
        h,
        int(config.num_hidden_layers),
        heads,
        int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim,
        int(config.intermediate_size),
    )


def matmul_params(config: PreTrainedConfig, head_outputs: int) -> int:
    """Parameters that take part in a matrix multiply per token (``head_outputs``: the vocabulary
    for a language model, 1 for a scalar reward head). Llama's MLP is gated (three matrices),
    BERT's is not (two)."""
    h, layers, heads, kv_heads, head_dim, intermediate = _shape(config)
    attention = h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h
    mlp = (2 if config.model_type == "bert" else 3) * h * intermediate
    return layers * (attention + mlp) + h * head_outputs


def train_flops_per_token(config: PreTrainedConfig, head_outputs: int, seq_len: int) -> float:
    """Forward + backward FLOPs per token at sequence length ``seq_len``."""
    _, layers, heads, _, head_dim, _ = _shape(config)
    return 6.0 * matmul_params(config, head_outputs) + 12.0 * layers * heads * head_dim * seq_len


def forward_flops_per_token(config: PreTrainedConfig, head_outputs: int, seq_len: int) -> float:
    return train_flops_per_token(config, head_outputs, seq_len) / 3.0


def gpu_peak_flops(name: str) -> float | None:
    """The dense bf16 peak of the GPU CUDA calls ``name``; ``None`` for a part not in
    :data:`GPU_PEAK_FLOPS` (an MFU against a guessed peak would mislead)."""
    for model, flops in GPU_PEAK_FLOPS:
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(model)}(?![A-Za-z0-9])", name):
            return flops
    return None


def peak_flops(metrics: MetricsConfig, device: torch.device) -> float | None:
    """Peak FLOP/s of this process's device (see the module docstring); ``None`` on a GPU whose
    peak is neither configured nor in the table: the run then reports no MFU."""
    if metrics.peak_flops > 0:
        return metrics.peak_flops
    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device))
    return metrics.cpu_peak_flops_per_thread * max(1, torch.get_num_threads())
