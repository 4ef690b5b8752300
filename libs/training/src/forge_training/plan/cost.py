"""The planner's estimates of one layout (see :mod:`forge_training.plan.planner` for the sources): memory
of the busiest pipeline stage, communication per step and per link, and step time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from forge_training.plan.spec import (
    ACTIVATION_BYTES,
    GRAD_BYTES,
    OPTIMIZER_BYTES,
    WEIGHT_BYTES,
    ZERO_STAGES,
    ModelSpec,
    ParallelConfig,
    PlanError,
    PlanRequest,
    Recompute,
    layer_params,
    matmul_params,
)

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
