"""Parallelism planner: tensor / pipeline / data parallel degrees and ZeRO stage for a training job.

Pure arithmetic, no I/O; ``plan_cli`` is the ``forge plan`` command around it. Every estimate is a
documented function below so it can be checked by hand:

- model states: mixed-precision Adam keeps 2 + 2 + 12 = 16 bytes per parameter (bf16 weights, bf16
  gradients, fp32 master weights + momentum + variance), divided by the data-parallel degree as
  ZeRO stage 1 / 2 / 3 shards optimizer state / + gradients / + weights (Rajbhandari et al. 2020);
- activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", ``sbh(34 + 5as/h)`` bytes per layer and its tensor-parallel, sequence-parallel,
  selective- and full-recompute variants;
- communication: ring collectives, each GPU sends ``2(n-1)/n`` × the buffer for an all-reduce and
  ``(n-1)/n`` × it for an all-gather or a reduce-scatter;
- step time: FLOPs at an assumed fraction of peak, plus the communication that cannot hide behind
  compute, plus the 1F1B pipeline bubble ``(pp-1)/m``.

``plan`` runs the search:

1. Validate the request (``PlanError`` names the offending field).
2. Enumerate layouts ``tp × pp × dp = gpus``; reject those that are not runnable (tensor parallel
   across nodes or not dividing the heads, pipeline stages not dividing the layers, a batch that
   does not split over the data-parallel ranks) with the reason.
3. For each runnable layout, each ZeRO stage and each recompute mode, estimate the memory of the
   busiest pipeline stage; reject what does not fit in the GPU's memory less the headroom.
4. Rank what fits by estimated step time (then by memory) and return the best, the best of each
   other layout as alternatives, and every rejection.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from typing import Any

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


# --------------------------------------------------------------------------------------------------
# Memory


def model_state_bytes(params: float, dp: int, zero: int) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes per GPU for ``params`` parameters on it.

    Mixed-precision Adam: 2 + 2 + 12 = 16 bytes per parameter (7B → 112 GB unsharded).
    ZeRO stage 1 divides the optimizer state by ``dp``, stage 2 also the gradients, stage 3 also
    the weights (ZeRO paper, 7.5B on 64 GPUs: 120, 31.4, 16.6, 1.9 GB).
    """
    if zero not in ZERO_STAGES:
        raise PlanError("zero", f"ZeRO stage must be one of {ZERO_STAGES}, got {zero}")
    weights = WEIGHT_BYTES * params / (dp if zero >= 3 else 1)
    grads = GRAD_BYTES * params / (dp if zero >= 2 else 1)
    optimizer = OPTIMIZER_BYTES * params / (dp if zero >= 1 else 1)
    return weights, grads, optimizer


def stage_params(model: ModelSpec, tp: int, pp: int, stage: int) -> float:
    """Parameters held by one GPU of pipeline stage ``stage`` (0-based) at tensor degree ``tp``.

    Each stage has layers/pp layers; weight matrices split over tp, the two norm vectors per layer
    are replicated. The first stage also holds the vocab-parallel input embedding (V·h/tp), the
    last one the output head (V·h/tp) and the final norm.
    """
    h, v = model.hidden, model.vocab
    norms = 2 * h
    per_layer = (layer_params(model) - norms) / tp + norms
    params = model.layers // pp * per_layer
    if stage == 0:
        params += v * h / tp
    if stage == pp - 1:
        params += v * h / tp + h
    return params


def activation_bytes_per_layer(
    s: int, b: int, h: int, a: int, *, tp: int = 1, sequence_parallel: bool = False, recompute: Recompute
) -> float:
    """Activation bytes one transformer layer keeps for backward, per micro-batch, per GPU.

    Korthikanti et al. 2022, Table 2 (s sequence, b micro-batch, h hidden, a heads, t tensor
    degree; 16-bit activations, 1-byte dropout masks):

    - no parallelism, no recompute:           sbh(34 + 5as/h)
    - tensor parallel:                        sbh(10 + 24/t + 5as/(ht))
    - tensor + sequence parallel:             sbh/t · (34 + 5as/h)
    - tensor parallel + selective recompute:  sbh(10 + 24/t)
    - tensor + sequence parallel + selective: sbh/t · 34
    - full recompute:                         2sbh (only the layer input), 2sbh/t with sequence
                                              parallel

    The 5as/h term is the attention core (scores, softmax, dropout): selective recompute drops it.
    Written for GPT's 4h GeLU MLP with dropout; for Llama's SwiGLU MLP it is an estimate of the same
    size (FlashAttention, like selective recompute, stores no s² term).
    """
    sbh = s * b * h
    t = tp
    if recompute is Recompute.FULL:
        return 2 * sbh / (t if sequence_parallel else 1)
    attention_core = 5 * a * s / h
    if recompute is Recompute.SELECTIVE:
        attention_core = 0.0
    if sequence_parallel:
        return sbh / t * (34 + attention_core)
    return sbh * (10 + 24 / t + attention_core / t)


def embedding_activation_bytes(s: int, b: int, h: int, tp: int) -> float:
    """Input embedding dropout mask, first stage: sbh/t bytes (Korthikanti et al. §4.3)."""
    return s * b * h / tp


def output_layer_activation_bytes(s: int, b: int, h: int, v: int, tp: int) -> float:
    """Final norm + projection + fp32 log-softmax, last stage: 4sbh/t · (1 + v/h) (§4.3)."""
    return 4 * s * b * h / tp * (1 + v / h)


def in_flight_micro_batches(pp: int, stage: int, m: int) -> int:
    """Micro-batches whose activations stage ``stage`` holds at once under 1F1B: min(pp - stage, m)."""
    return min(pp - stage, m)


def zero3_buffer_bytes(model: ModelSpec, tp: int) -> float:
    """ZeRO-3 working set: two gathered units of bf16 weights (current + prefetched) and one of bf16
    gradients before its reduce-scatter; a unit is a layer or the embedding, whichever is larger."""
    unit = max(layer_params(model), model.vocab * model.hidden) / tp
    return (2 * WEIGHT_BYTES + GRAD_BYTES) * unit


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU on the busiest pipeline stage."""

    stage: int
    weights: float
    grads: float
    optimizer: float
    activations: float
    buffers: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.buffers


def stage_activation_bytes(req: PlanRequest, cfg: ParallelConfig, stage: int, recompute: Recompute) -> float:
    """Activations of one stage: in-flight micro-batches × (its layers + embedding/output terms),
    plus the one layer rematerialised during backward when recomputing."""
    m = req.model
    s, b, h, t = req.seq_len, cfg.micro_batch, m.hidden, cfg.tp
    sp = cfg.sequence_parallel

    def per_layer(mode: Recompute) -> float:
        return activation_bytes_per_layer(s, b, h, m.heads, tp=t, sequence_parallel=sp, recompute=mode)

    held = m.layers // cfg.pp * per_layer(recompute)
    if stage == 0:
        held += embedding_activation_bytes(s, b, h, t)
    if stage == cfg.pp - 1:
        held += output_layer_activation_bytes(s, b, h, m.vocab, t)
    working = per_layer(Recompute.NONE) - per_layer(recompute)
    return in_flight_micro_batches(cfg.pp, stage, cfg.micro_batches) * held + working


def stage_memory(req: PlanRequest, cfg: ParallelConfig, stage: int) -> MemoryBreakdown:
    """Memory of one GPU of pipeline stage ``stage``."""
    weights, grads, optimizer = model_state_bytes(
        stage_params(req.model, cfg.tp, cfg.pp, stage), cfg.dp, cfg.zero
    )
    buffers = zero3_buffer_bytes(req.model, cfg.tp) if cfg.zero == 3 and cfg.dp > 1 else 0.0
    activations = stage_activation_bytes(req, cfg, stage, cfg.recompute)
    return MemoryBreakdown(stage, weights, grads, optimizer, activations, buffers)


def peak_memory(req: PlanRequest, cfg: ParallelConfig) -> MemoryBreakdown:
    """The busiest stage: the first (embedding, most micro-batches in flight) or the last (head,
    logits); middle stages hold no more than the first."""
    return max((stage_memory(req, cfg, st) for st in {0, cfg.pp - 1}), key=lambda mb: mb.total)


# --------------------------------------------------------------------------------------------------
# Communication


def ring_allreduce_bytes(n: int, buffer_bytes: float) -> float:
    """Bytes each GPU sends in a ring all-reduce of ``buffer_bytes`` over n GPUs: 2(n-1)/n · bytes."""
    return 2 * (n - 1) / n * buffer_bytes


def ring_allgather_bytes(n: int, buffer_bytes: float) -> float:
    """Bytes each GPU sends to all-gather (or reduce-scatter) a ``buffer_bytes`` tensor: (n-1)/n."""
    return (n - 1) / n * buffer_bytes


def tp_collectives_per_layer(recompute: Recompute) -> int:
    """All-reduce-sized collectives per layer per micro-batch (Megatron): 2 in forward (after
    attention, after the MLP), 2 in backward, 2 more when full recompute re-runs the forward.
    Sequence parallelism swaps each all-reduce for an all-gather + reduce-scatter of the same volume."""
    return 6 if recompute is Recompute.FULL else 4


def tp_comm_bytes(req: PlanRequest, cfg: ParallelConfig) -> float:
    """Tensor-parallel bytes sent per GPU per step: layers/pp × m × collectives × all-reduce(sbh·2)."""
    if cfg.tp == 1:
        return 0.0
    activation = ACTIVATION_BYTES * req.seq_len * cfg.micro_batch * req.model.hidden
    per_layer = tp_collectives_per_layer(cfg.recompute) * ring_allreduce_bytes(cfg.tp, activation)
    return req.model.layers // cfg.pp * cfg.micro_batches * per_layer


def pp_comm_bytes(req: PlanRequest, cfg: ParallelConfig) -> float:
    """Pipeline point-to-point bytes per GPU per step: each micro-batch's activation forward and its
    gradient backward, 2 × m × sbh·2 bytes, divided by t when sequence parallel shards them."""
    if cfg.pp == 1:
        return 0.0
    activation = ACTIVATION_BYTES * req.seq_len * cfg.micro_batch * req.model.hidden
    shards = cfg.tp if cfg.sequence_parallel else 1
    return 2 * cfg.micro_batches * activation / shards


def dp_comm_bytes(params: float, dp: int, zero: int, m: int) -> tuple[float, float]:
    """Data-parallel bytes per GPU per step as (per micro-batch total, once per step), for
    ``params`` parameters on the GPU, gradients moved in bf16 (2·params bytes = G).

    - ZeRO-0 (DDP): gradients accumulate locally, one all-reduce per step: 2(n-1)/n · G.
    - ZeRO-1: reduce-scatter of gradients + all-gather of updated weights, the same 2(n-1)/n · G.
    - ZeRO-2: no full gradient is kept, so every micro-batch reduce-scatters: m(n-1)/n · G, then one
      weight all-gather per step (n-1)/n · G.
    - ZeRO-3: every micro-batch all-gathers weights for forward and again for backward and
      reduce-scatters gradients: 3m(n-1)/n · G (1.5× DDP at m = 1, as in the ZeRO paper).
    """
    if dp == 1:
        return 0.0, 0.0
    g = GRAD_BYTES * params
    if zero in (0, 1):
        return 0.0, ring_allreduce_bytes(dp, g)
    if zero == 2:
        return m * ring_allgather_bytes(dp, g), ring_allgather_bytes(dp, g)
    return 3 * m * ring_allgather_bytes(dp, g), 0.0


@dataclass(frozen=True)
class CommVolume:
    """Bytes one GPU sends per step, and the link each group uses (rank order: tp, then dp, then pp)."""

    tp_bytes: float
    pp_bytes: float
    dp_bytes_per_micro_batch: float
    dp_bytes_per_step: float
    tp_link: str
    pp_link: str
    dp_link: str

    @property
    def dp_bytes(self) -> float:
        return self.dp_bytes_per_micro_batch + self.dp_bytes_per_step


def links(req: PlanRequest, cfg: ParallelConfig) -> tuple[str, str, str]:
    """Which link (``intra`` or ``inter`` node) the tp, pp and dp groups ride on.

    Ranks are laid out tp fastest, then dp, then pp, so a tp group stays in a node (tp ≤ GPUs per
    node), a dp group leaves it when tp·dp exceeds the node, a pipeline when the job does.
    """
    gpn = req.gpu.gpus_per_node
    dp_link = "inter" if cfg.tp * cfg.dp > gpn else "intra"
    pp_link = "inter" if req.gpus > gpn else "intra"
    return "intra", pp_link, dp_link


def comm_volume(req: PlanRequest, cfg: ParallelConfig) -> CommVolume:
    """All communication of one step for one GPU of the stage with the most parameters."""
    params = max(stage_params(req.model, cfg.tp, cfg.pp, st) for st in {0, cfg.pp - 1})
    per_mb, per_step = dp_comm_bytes(params, cfg.dp, cfg.zero, cfg.micro_batches)
    tp_link, pp_link, dp_link = links(req, cfg)
    return CommVolume(
        tp_comm_bytes(req, cfg), pp_comm_bytes(req, cfg), per_mb, per_step, tp_link, pp_link, dp_link
    )


# --------------------------------------------------------------------------------------------------
# Time


def model_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """Training FLOPs per token (PaLM, appendix B): 6 × matmul parameters + 12·L·h·s for attention
    scores and scores × V (forward 1/3, backward 2/3)."""
    return 6 * matmul_params(model) + 12 * model.layers * model.hidden * seq_len


def recompute_flops_per_token(model: ModelSpec, seq_len: int, recompute: Recompute) -> float:
    """Extra FLOPs per token that recomputation adds: selective re-runs the attention core's
    forward (4·L·h·s), full re-runs every layer's forward (2 × layer parameters + 4·L·h·s)."""
    attention_forward = 4 * model.layers * model.hidden * seq_len
    if recompute is Recompute.NONE:
        return 0.0
    if recompute is Recompute.SELECTIVE:
        return float(attention_forward)
    return 2 * model.layers * layer_params(model) + attention_forward


def pipeline_bubble_fraction(pp: int, m: int) -> float:
    """Idle fraction of 1F1B relative to the useful time: (pp - 1) / m (Narayanan et al. 2021)."""
    return (pp - 1) / m


@dataclass(frozen=True)
class StepTime:
    """Estimated seconds of one optimizer step; ``total_s`` = the sum of the parts."""

    compute_s: float
    bubble_s: float
    tp_comm_s: float
    pp_comm_s: float
    dp_exposed_s: float
    dp_comm_s: float  # all data-parallel traffic, the part hidden behind compute included
    mfu: float  # achieved model FLOPs / (GPUs × peak × step time)
    tokens_per_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.bubble_s + self.tp_comm_s + self.pp_comm_s + self.dp_exposed_s


def step_time(req: PlanRequest, cfg: ParallelConfig, comm: CommVolume) -> StepTime:
    """Step time of a 1F1B pipeline: (m + pp - 1) slots, each one micro-batch of compute plus its
    tensor-parallel and pipeline transfers (on the critical path), plus the data-parallel traffic
    that does not hide behind compute. Backward is 2/3 of a micro-batch's compute. Per-step traffic
    (ZeRO-0/1 gradients, ZeRO-2 weight all-gather) overlaps the last micro-batch's backward; ZeRO-2's
    per-micro-batch reduce-scatter overlaps that micro-batch's backward; ZeRO-3's gathers and
    reduce-scatter overlap the whole micro-batch (forward gathers in forward, the rest in backward)."""
    gpu, m = req.gpu, cfg.micro_batches
    tokens = req.tokens_per_step
    flops = tokens * (
        model_flops_per_token(req.model, req.seq_len)
        + recompute_flops_per_token(req.model, req.seq_len, cfg.recompute)
    )
    compute_mb = flops / req.gpus / m / (gpu.peak_flops * req.mfu)

    def bandwidth(link: str) -> float:
        return (gpu.intra_node_bw if link == "intra" else gpu.inter_node_bw) * req.link_efficiency

    tp_mb = comm.tp_bytes / m / bandwidth(comm.tp_link)
    pp_mb = comm.pp_bytes / m / bandwidth(comm.pp_link)
    dp_mb = comm.dp_bytes_per_micro_batch / m / bandwidth(comm.dp_link)
    dp_step = comm.dp_bytes_per_step / bandwidth(comm.dp_link)
    backward_mb = compute_mb * 2 / 3
    dp_mb_window = backward_mb if cfg.zero == 2 else compute_mb
    dp_exposed = m * max(0.0, dp_mb - dp_mb_window) + max(0.0, dp_step - backward_mb)
    slot = compute_mb + tp_mb + pp_mb
    parts = StepTime(
        compute_s=m * compute_mb,
        bubble_s=(cfg.pp - 1) * slot,
        tp_comm_s=m * tp_mb,
        pp_comm_s=m * pp_mb,
        dp_exposed_s=dp_exposed,
        dp_comm_s=m * dp_mb + dp_step,
        mfu=0.0,
        tokens_per_s=0.0,
    )
    model_flops = tokens * model_flops_per_token(req.model, req.seq_len)
    return replace(
        parts,
        mfu=model_flops / (req.gpus * gpu.peak_flops * parts.total_s),
        tokens_per_s=tokens / parts.total_s,
    )


# --------------------------------------------------------------------------------------------------
# Search


@dataclass(frozen=True)
class Candidate:
    """One evaluated configuration."""

    config: ParallelConfig
    memory: MemoryBreakdown
    activations_by_recompute: dict[str, float]  # the same stage under each recompute mode
    comm: CommVolume
    time: StepTime
    usable_bytes: float

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.usable_bytes

    @property
    def bubble_fraction(self) -> float:
        return pipeline_bubble_fraction(self.config.pp, self.config.micro_batches)


@dataclass(frozen=True)
class Rejection:
    """A layout or configuration that was not chosen, and why."""

    tp: int
    pp: int
    dp: int
    reason: str  # a key of REASONS
    detail: str
    zero: int | None = None
    recompute: str | None = None
    needed_bytes: float | None = None


REASONS = {
    "tp_exceeds_node": "tensor parallel wider than a node",
    "tp_heads": "tensor degree does not divide the attention heads",
    "tp_kv_heads": "tensor degree does not divide the KV heads",
    "pp_layers": "pipeline degree does not divide the layers",
    "batch_dp": "global batch does not split over the data-parallel ranks",
    "micro_batch": "per-rank batch does not split into micro-batches",
    "memory": "over memory",
}


def layout_rejection(req: PlanRequest, tp: int, pp: int, dp: int) -> Rejection | None:
    """Why a (tp, pp, dp) layout cannot run at all, or None."""
    model, gpn = req.model, req.gpu.gpus_per_node

    def reject(reason: str, detail: str) -> Rejection:
        return Rejection(tp, pp, dp, reason, detail)

    if tp > gpn:
        return reject("tp_exceeds_node", f"tp={tp} > {gpn} GPUs per node")
    if model.heads % tp:
        return reject("tp_heads", f"tp={tp} does not divide {model.heads} heads")
    if model.kv_heads % tp:
        return reject("tp_kv_heads", f"tp={tp} does not divide {model.kv_heads} KV heads")
    if model.layers % pp:
        return reject("pp_layers", f"pp={pp} does not divide {model.layers} layers")
    if req.global_batch_seqs % dp:
        return reject("batch_dp", f"{req.global_batch_seqs} sequences do not split over dp={dp}")
    if req.global_batch_seqs // dp % req.micro_batch:
        return reject(
            "micro_batch",
            f"{req.global_batch_seqs // dp} sequences per rank do not split into micro-batches of {req.micro_batch}",
        )
    return None


def evaluate(req: PlanRequest, cfg: ParallelConfig) -> Candidate:
    """Memory, communication and step time of one configuration (fitting or not)."""
    memory = peak_memory(req, cfg)
    by_mode = {mode.value: stage_activation_bytes(req, cfg, memory.stage, mode) for mode in Recompute}
    comm = comm_volume(req, cfg)
    return Candidate(cfg, memory, by_mode, comm, step_time(req, cfg, comm), req.usable_bytes)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Plan:
    """The search's answer: the best configuration, the best of each other layout, the rejections."""

    request: PlanRequest
    best: Candidate
    alternatives: tuple[Candidate, ...]
    rejected: tuple[Rejection, ...]
    evaluated: int
    fitting: int

    def to_dict(self) -> dict[str, Any]:
        req = self.request
        return {
            "request": {
                "model": {**asdict(req.model), "params": param_count(req.model)},
                "gpu": asdict(req.gpu),
                "gpus": req.gpus,
                "seq_len": req.seq_len,
                "global_batch_seqs": req.global_batch_seqs,
                "global_batch_tokens": req.tokens_per_step,
                "micro_batch": req.micro_batch,
                "mfu_assumed": req.mfu,
                "headroom": req.headroom,
                "link_efficiency": req.link_efficiency,
                "usable_bytes_per_gpu": req.usable_bytes,
            },
            "best": candidate_dict(self.best),
            "alternatives": [candidate_dict(c) for c in self.alternatives],
            "evaluated": self.evaluated,
            "fitting": self.fitting,
            "rejected": [asdict(r) for r in self.rejected],
        }


def candidate_dict(c: Candidate) -> dict[str, Any]:
    cfg = c.config
    return {
        "tp": cfg.tp,
        "pp": cfg.pp,
        "dp": cfg.dp,
        "zero": cfg.zero,
        "recompute": cfg.recompute.value,
        "sequence_parallel": cfg.sequence_parallel,
        "micro_batch": cfg.micro_batch,
        "micro_batches": cfg.micro_batches,
        "memory_bytes": {
            "stage": c.memory.stage,
            "weights": c.memory.weights,
            "grads": c.memory.grads,
            "optimizer": c.memory.optimizer,
            "activations": c.memory.activations,
            "buffers": c.memory.buffers,
            "total": c.memory.total,
            "usable": c.usable_bytes,
        },
        "activations_bytes_by_recompute": c.activations_by_recompute,
        "comm_bytes_per_step": {
            "tp": c.comm.tp_bytes,
            "pp": c.comm.pp_bytes,
            "dp": c.comm.dp_bytes,
            "links": {"tp": c.comm.tp_link, "pp": c.comm.pp_link, "dp": c.comm.dp_link},
        },
        "time_s": {
            "step": c.time.total_s,
            "compute": c.time.compute_s,
            "bubble": c.time.bubble_s,
            "tp_comm": c.time.tp_comm_s,
            "pp_comm": c.time.pp_comm_s,
            "dp_comm": c.time.dp_comm_s,
            "dp_exposed": c.time.dp_exposed_s,
        },
        "bubble_fraction": c.bubble_fraction,
        "mfu": c.time.mfu,
        "tokens_per_s": c.time.tokens_per_s,
    }


def rank_key(c: Candidate) -> tuple[float, float, int, int]:
    """Fastest first; among equals, less memory, then fewer model-parallel GPUs, then lower ZeRO."""
    return (round(c.time.total_s, 9), c.memory.total, c.config.tp * c.config.pp, c.config.zero)


def plan(req: PlanRequest) -> Plan:
    """Search every layout, ZeRO stage and recompute mode; see the module docstring."""
    # 1. Validate.
    validate_request(req)
    # 2. Enumerate layouts tp × pp × dp = gpus and drop those that cannot run.
    rejected: list[Rejection] = []
    fitting: list[Candidate] = []
    evaluated = 0
    for tp in divisors(req.gpus):
        for pp in divisors(req.gpus // tp):
            dp = req.gpus // (tp * pp)
            layout_reason = layout_rejection(req, tp, pp, dp)
            if layout_reason is not None:
                rejected.append(layout_reason)
                continue
            # 3. Every ZeRO stage (only 0 without data parallelism) and recompute mode; keep what fits.
            for zero in ZERO_STAGES if dp > 1 else (0,):
                for mode in Recompute:
                    cfg = ParallelConfig(
                        tp=tp,
                        pp=pp,
                        dp=dp,
                        zero=zero,
                        recompute=mode,
                        micro_batch=req.micro_batch,
                        micro_batches=req.global_batch_seqs // (dp * req.micro_batch),
                        sequence_parallel=req.sequence_parallel and tp > 1,
                    )
                    cand = evaluate(req, cfg)
                    evaluated += 1
                    if cand.fits:
                        fitting.append(cand)
                        continue
                    rejected.append(
                        Rejection(
                            tp,
                            pp,
                            dp,
                            "memory",
                            f"needs {cand.memory.total / GIB:.1f} GiB > {req.usable_bytes / GIB:.1f} GiB usable",
                            zero=zero,
                            recompute=mode.value,
                            needed_bytes=cand.memory.total,
                        )
                    )
    if not fitting:
        raise PlanError("gpus", nothing_fits_message(req, rejected))
    # 4. Rank; alternatives are the best of each other layout.
    fitting.sort(key=rank_key)
    best = fitting[0]
    seen = {(best.config.tp, best.config.pp)}
    alternatives: list[Candidate] = []
    for cand in fitting[1:]:
        if len(alternatives) >= req.top:
            break
        layout = (cand.config.tp, cand.config.pp)
        if layout not in seen:
            seen.add(layout)
            alternatives.append(cand)
    return Plan(req, best, tuple(alternatives), tuple(rejected), evaluated, len(fitting))


def nothing_fits_message(req: PlanRequest, rejected: list[Rejection]) -> str:
    """Why no configuration is left, with the closest miss when memory was the obstacle."""
    over = [r for r in rejected if r.needed_bytes is not None]
    if over:
        closest = min(over, key=lambda r: r.needed_bytes or 0.0)
        return (
            f"no configuration of {req.gpus} × {req.gpu.name} fits {req.model.name} in memory; closest: "
            f"tp={closest.tp} pp={closest.pp} dp={closest.dp} ZeRO-{closest.zero} {closest.recompute} "
            f"{closest.detail}. Use more GPUs, a larger GPU type, a smaller --micro-batch or --headroom"
        )
    reasons = sorted({REASONS[r.reason] for r in rejected})
    return f"no runnable layout for {req.gpus} GPUs ({'; '.join(reasons)})"
