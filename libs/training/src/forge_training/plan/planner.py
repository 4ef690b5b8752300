"""Parallelism planner: tensor / pipeline / data parallel degrees and ZeRO stage for a training job.

Pure arithmetic, no I/O; :mod:`.cli` is the ``forge plan`` command around it. What it plans for
(models, GPUs, the request, a layout) is :mod:`.spec`; every estimate is a documented function
of :mod:`.cost` so it can be checked by hand, and the search is here:

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

from dataclasses import asdict, dataclass
from typing import Any

from forge_training.plan.cost import (
    CommVolume,
    MemoryBreakdown,
    StepTime,
    comm_volume,
    peak_memory,
    pipeline_bubble_fraction,
    stage_activation_bytes,
    step_time,
)
from forge_training.plan.spec import (
    GIB,
    ZERO_STAGES,
    ParallelConfig,
    PlanError,
    PlanRequest,
    Recompute,
    param_count,
    validate_request,
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
