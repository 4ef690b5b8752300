"""What the parallelism planner plans for (see :mod:`forge_training.plan.planner`): the byte sizes of
mixed-precision training, models and their presets, GPUs and theirs, the request and a parallel
layout, each checked with a :class:`PlanError` naming the field.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from enum import StrEnum

GIB = 2**30

WEIGHT_BYTES = 2
"""bf16 weights used in forward and backward."""
GRAD_BYTES = 2
"""bf16 gradients (also the dtype the data-parallel gradient collectives move)."""
OPTIMIZER_BYTES = 12
"""fp32 master weights, Adam momentum and variance: 4 + 4 + 4."""
MODEL_STATE_BYTES = WEIGHT_BYTES + GRAD_BYTES + OPTIMIZER_BYTES
ACTIVATION_BYTES = 2
"""bf16 activations sent between pipeline stages and through tensor-parallel collectives."""

DEFAULT_MFU = 0.5
"""Fraction of peak bf16 FLOP/s the compute kernels sustain, before communication and bubble.
With it, llama-70b on 512 A100-80GB comes out near 320 tokens/s/GPU, the rate implied by the
Llama 2 paper (1.72M A100-80GB GPU-hours for 2T tokens)."""
DEFAULT_HEADROOM = 0.10
"""Fraction of GPU memory kept free for the CUDA context, NCCL buffers and allocator fragmentation."""
DEFAULT_LINK_EFFICIENCY = 0.8
"""Fraction of a link's nominal bandwidth a ring collective achieves (NCCL bus bandwidth)."""
ZERO_STAGES = (0, 1, 2, 3)


class PlanError(ValueError):
    """Bad input or an impossible request; ``field`` names the input at fault (CLI: ``--field``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class Recompute(StrEnum):
    """Activation checkpointing modes of Korthikanti et al. 2022."""

    NONE = "none"
    SELECTIVE = "selective"  # recompute only the attention core (softmax, dropout, scores × V)
    FULL = "full"  # store each layer's input, recompute the whole layer in backward


# --------------------------------------------------------------------------------------------------
# Models


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only Llama-style transformer: GQA attention, SwiGLU MLP, RMSNorm, untied head."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int


MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("llama-7b", layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000),
        ModelSpec("llama-13b", layers=40, hidden=5120, heads=40, kv_heads=40, ffn=13824, vocab=32000),
        ModelSpec("llama-70b", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=32000),
        ModelSpec("llama3-8b", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256),
        ModelSpec("llama3-70b", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256),
        ModelSpec("llama3-405b", layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256),
    )
}


def layer_params(model: ModelSpec) -> int:
    """Parameters of one transformer layer.

    Attention: Q and O are h×h, K and V are h×(kv_heads·head_dim); SwiGLU MLP: gate, up and down are
    h×ffn each; two RMSNorm weight vectors of h.
    """
    h = model.hidden
    kv_width = model.kv_heads * (h // model.heads)
    return 2 * h * h + 2 * h * kv_width + 3 * h * model.ffn + 2 * h


def param_count(model: ModelSpec) -> int:
    """All parameters: layers, input embedding V×h, output head V×h (untied) and the final norm."""
    return model.layers * layer_params(model) + 2 * model.vocab * model.hidden + model.hidden


def matmul_params(model: ModelSpec) -> int:
    """Parameters that take part in matrix multiplies: all but the input embedding (a lookup)."""
    return model.layers * layer_params(model) + model.vocab * model.hidden


def shape_for_params(params: int, vocab: int = 32000) -> ModelSpec:
    """A Llama-shaped model of about ``params`` parameters, for a size given without a preset.

    Follows the Llama family's proportions: head dimension 128, hidden ≈ 128 × layers,
    ffn = 8h/3 rounded up to a multiple of 256, full multi-head attention. Then per layer ≈ 12h²,
    so params ≈ 12h³/128 + 2Vh; solve for h, round the head count to a multiple of 8 and the
    layer count to a multiple of 4 so that tensor and pipeline degrees divide them.
    """
    low, high = 1.0, 1e6
    for _ in range(200):
        mid = (low + high) / 2
        if 12 * mid**3 / 128 + 2 * vocab * mid < params:
            low = mid
        else:
            high = mid
    heads = max(1, round(low / 128))
    if heads >= 8:
        heads = max(8, 8 * round(heads / 8))
    hidden = 128 * heads
    ffn = 256 * math.ceil(8 * hidden / 3 / 256)
    per_layer = 4 * hidden * hidden + 3 * hidden * ffn
    layers = max(1, round((params - 2 * vocab * hidden) / per_layer))
    if layers >= 4:
        layers = 4 * round(layers / 4)
    return ModelSpec(f"{params / 1e9:g}B", layers, hidden, heads, heads, ffn, vocab)


def validate_model(model: ModelSpec) -> None:
    """Refuse shapes a transformer cannot have."""
    for field_name in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab"):
        if getattr(model, field_name) <= 0:
            raise PlanError(field_name, f"must be positive, got {getattr(model, field_name)}")
    if model.hidden % model.heads:
        raise PlanError("heads", f"{model.heads} heads do not divide hidden size {model.hidden}")
    if model.heads % model.kv_heads:
        raise PlanError("kv_heads", f"{model.kv_heads} KV heads do not divide {model.heads} heads")


_COUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgbt]?)\s*$", re.IGNORECASE)
_SUFFIX_POWER = {"": 0, "k": 1, "m": 2, "g": 3, "b": 3, "t": 4}


def parse_count(text: str, *, field: str, binary: bool) -> int:
    """A positive count like ``4M``, ``70B``, ``1.5e9`` or ``1024``.

    Suffixes K, M, G (or B, billion) and T are powers of 1000, or of 1024 with ``binary``: token
    batches are quoted in binary units (Llama 2's "4M tokens" is 1024 sequences × 4096).
    """
    match = _COUNT.match(text)
    if match is None:
        raise PlanError(field, f"{text!r} is not a count such as 4M, 70B or 1024")
    value = float(match.group(1)) * (1024 if binary else 1000) ** _SUFFIX_POWER[match.group(2).lower()]
    count = round(value)
    if count <= 0:
        raise PlanError(field, f"must be positive, got {text!r}")
    return count


def resolve_model(
    text: str,
    *,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    ffn: int | None = None,
    vocab: int | None = None,
) -> ModelSpec:
    """A preset name (``llama-70b``) or a parameter count (``7B``), with any given shape field
    overriding the preset's or the derived one."""
    key = text.strip().lower()
    if key in MODEL_PRESETS:
        model = MODEL_PRESETS[key]
    else:
        try:
            params = parse_count(key, field="model", binary=False)
        except PlanError:
            raise PlanError(
                "model",
                f"unknown preset {text!r}; choose one of {', '.join(MODEL_PRESETS)} "
                "or give a parameter count such as 7B",
            ) from None
        model = shape_for_params(params, vocab=vocab or 32000)
    model = ModelSpec(
        name=model.name,
        layers=model.layers if layers is None else layers,
        hidden=model.hidden if hidden is None else hidden,
        heads=model.heads if heads is None else heads,
        kv_heads=model.kv_heads if kv_heads is None else kv_heads,
        ffn=model.ffn if ffn is None else ffn,
        vocab=model.vocab if vocab is None else vocab,
    )
    validate_model(model)
    return model


# --------------------------------------------------------------------------------------------------
# GPUs


@dataclass(frozen=True)
class GpuSpec:
    """One GPU type. Bandwidths are per GPU, one direction, nominal (before link efficiency)."""

    name: str
    memory_bytes: int
    peak_flops: float  # dense bf16
    intra_node_bw: float  # bytes/s, NVLink (or PCIe) to a GPU in the same node
    inter_node_bw: float  # bytes/s, this GPU's share of the network (one NIC per GPU)
    gpus_per_node: int = 8


MIB = 2**20
GPU_PRESETS: dict[str, GpuSpec] = {
    g.name.lower(): g
    for g in (
        # Memory is the total nvidia-smi reports. A100: NVLink 3 600 GB/s both ways, one 200 Gb/s
        # HDR NIC per GPU (DGX A100). H100/H200: NVLink 4 900 GB/s both ways, one 400 Gb/s NDR NIC
        # per GPU (DGX H100). L40S: no NVLink, PCIe Gen4 x16, 100 Gb/s per GPU assumed.
        GpuSpec("A100-40GB", 40960 * MIB, 312e12, 300e9, 25e9),
        GpuSpec("A100-80GB", 81920 * MIB, 312e12, 300e9, 25e9),
        GpuSpec("H100-80GB", 81559 * MIB, 989e12, 450e9, 50e9),
        GpuSpec("H200", 143771 * MIB, 989e12, 450e9, 50e9),
        GpuSpec("L40S", 46068 * MIB, 362e12, 32e9, 12.5e9),
    )
}
CUSTOM_GPU = "custom"


def resolve_gpu(
    name: str,
    *,
    memory_gib: float | None = None,
    tflops: float | None = None,
    intra_node_gbs: float | None = None,
    inter_node_gbs: float | None = None,
    gpus_per_node: int | None = None,
) -> GpuSpec:
    """A preset (case-insensitive) or ``custom``; any given figure overrides the preset's.

    ``custom`` needs all four figures: memory (GiB), peak bf16 TFLOP/s, and the intra- and
    inter-node bandwidths (GB/s per GPU, one direction).
    """
    key = name.strip().lower()
    figures = {
        "gpu_memory_gib": memory_gib,
        "gpu_tflops": tflops,
        "intra_node_gbs": intra_node_gbs,
        "inter_node_gbs": inter_node_gbs,
        "gpus_per_node": gpus_per_node,
    }
    for field_name, value in figures.items():
        if value is not None and value <= 0:
            raise PlanError(field_name, f"must be positive, got {value}")
    if key == CUSTOM_GPU:
        missing = [f for f, v in figures.items() if v is None and f != "gpus_per_node"]
        if missing:
            raise PlanError(missing[0], f"required with --gpu-type custom (missing: {', '.join(missing)})")
        base = GpuSpec("custom", 0, 0.0, 0.0, 0.0)
    elif key in GPU_PRESETS:
        base = GPU_PRESETS[key]
    else:
        choices = ", ".join([g.name for g in GPU_PRESETS.values()] + [CUSTOM_GPU])
        raise PlanError("gpu_type", f"unknown GPU type {name!r}; choose one of {choices}")
    return replace(
        base,
        memory_bytes=base.memory_bytes if memory_gib is None else round(memory_gib * GIB),
        peak_flops=base.peak_flops if tflops is None else tflops * 1e12,
        intra_node_bw=base.intra_node_bw if intra_node_gbs is None else intra_node_gbs * 1e9,
        inter_node_bw=base.inter_node_bw if inter_node_gbs is None else inter_node_gbs * 1e9,
        gpus_per_node=base.gpus_per_node if gpus_per_node is None else gpus_per_node,
    )


# --------------------------------------------------------------------------------------------------
# Request and configuration


@dataclass(frozen=True)
class PlanRequest:
    """What to plan for. ``global_batch_seqs`` sequences of ``seq_len`` tokens per optimizer step."""

    model: ModelSpec
    gpu: GpuSpec
    gpus: int
    seq_len: int
    global_batch_seqs: int
    micro_batch: int = 1
    mfu: float = DEFAULT_MFU
    headroom: float = DEFAULT_HEADROOM
    link_efficiency: float = DEFAULT_LINK_EFFICIENCY
    sequence_parallel: bool = True
    top: int = 5

    @property
    def usable_bytes(self) -> float:
        """GPU memory a configuration may use: total less the headroom."""
        return self.gpu.memory_bytes * (1 - self.headroom)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_seqs * self.seq_len


def global_batch_seqs(seq_len: int, *, tokens: int | None, seqs: int | None) -> int:
    """Sequences per step from exactly one of a token count and a sequence count."""
    if (tokens is None) == (seqs is None):
        raise PlanError(
            "global_batch_tokens", "give exactly one of --global-batch-tokens and --global-batch-seqs"
        )
    if seqs is not None:
        if seqs <= 0:
            raise PlanError("global_batch_seqs", f"must be positive, got {seqs}")
        return seqs
    assert tokens is not None
    if seq_len <= 0:
        raise PlanError("seq_len", f"must be positive, got {seq_len}")
    if tokens <= 0:
        raise PlanError("global_batch_tokens", f"must be positive, got {tokens}")
    if tokens % seq_len:
        raise PlanError(
            "global_batch_tokens", f"{tokens} tokens is not a whole number of {seq_len}-token sequences"
        )
    return tokens // seq_len


def validate_request(req: PlanRequest) -> None:
    """Refuse a request no plan can answer, naming the field."""
    if req.gpus <= 0:
        raise PlanError("gpus", f"must be positive, got {req.gpus}")
    if req.seq_len <= 0:
        raise PlanError("seq_len", f"must be positive, got {req.seq_len}")
    if req.global_batch_seqs <= 0:
        raise PlanError("global_batch_seqs", f"must be positive, got {req.global_batch_seqs}")
    if req.micro_batch <= 0:
        raise PlanError("micro_batch", f"must be positive, got {req.micro_batch}")
    if not 0 < req.mfu <= 1:
        raise PlanError("mfu", f"must be in (0, 1], got {req.mfu}")
    if not 0 <= req.headroom < 1:
        raise PlanError("headroom", f"must be in [0, 1), got {req.headroom}")
    if not 0 < req.link_efficiency <= 1:
        raise PlanError("link_efficiency", f"must be in (0, 1], got {req.link_efficiency}")
    if req.top < 0:
        raise PlanError("top", f"must be zero or positive, got {req.top}")
    if req.gpu.memory_bytes <= 0 or req.gpu.peak_flops <= 0 or req.gpu.gpus_per_node <= 0:
        raise PlanError("gpu_type", "GPU memory, peak FLOP/s and GPUs per node must be positive")
    validate_model(req.model)


@dataclass(frozen=True)
class ParallelConfig:
    """One point of the search. ``micro_batches`` (m) = global batch / (dp × micro_batch)."""

    tp: int
    pp: int
    dp: int
    zero: int
    recompute: Recompute
    micro_batch: int
    micro_batches: int
    sequence_parallel: bool

    def label(self) -> str:
        return f"tp={self.tp} pp={self.pp} dp={self.dp} ZeRO-{self.zero} {self.recompute.value}"
