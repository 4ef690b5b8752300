"""The training loop, the same for every task: data parallelism over whatever process group is
initialised (gloo on CPU, NCCL on GPU; CPU ranks of one host sum through shared memory, see
:mod:`shm_allreduce`) with DistributedDataParallel or FSDP2 (``parallelism``; see :mod:`parallel`), AdamW, warmup + cosine, clipping, accumulation.
What differs per task (data, model, loss, evaluation, export) is an
:class:`~forge_training.objectives.Objective`.

:func:`train` runs these steps:

1. validate the recipe for this world size (before any work); pick the rank's device
   (:mod:`device`: ``cuda:LOCAL_RANK`` when the job has GPUs, else the CPU);
2. build the objective from the seed: data (rank 0 prepares token shards first), model (from
   scratch or from ``init.parent``), sampler; apply activation checkpointing and
   ``torch.compile`` when asked (:mod:`precision`); under FSDP shard the model now over a mesh of
   the device's type (the optimizer must hold the sharded parameters); move the model to the device;
3. build optimizer and schedule;
4. resume from the newest complete checkpoint, if any (model, optimizer, schedule, RNG, sampler
   position, task state); on a fresh run log the starting model's metrics (step 0); under DDP wrap
   the model now;
5. for each step: take this rank's prefetched batch (pinned by the prefetch thread on a GPU rank,
   copied without blocking), forward (under autocast for ``bf16``/``fp16``) and backward (the
   loss scaled for ``fp16``) per micro-batch (gradient sync only on the last), sum the step's
   loss units and figures over the ranks, divide the gradients by the global units (unscaled
   first under ``fp16``) and clip (the global norm, over shards under FSDP), step, log loss,
   figures, tokens/s, MFU and the GPU memory high-water mark; evaluate (under the same autocast)
   and checkpoint on their intervals (a fixed step count or the Young/Daly interval, re-planned
   after the first measured save); at a ``rung_cooldown`` step, evaluate after a cooldown branch
   and go on from the state before it (:mod:`cooldown`); on a stop request (SIGTERM) checkpoint
   and return ``preempted``;
6. at the end: final checkpoint, wait for it to publish, export in Hugging Face format (under
   FSDP from the gathered full state, as the plain model class); rank 0 draws the loss and
   learning-rate curves as ``curves.png`` beside ``metrics.jsonl`` (:mod:`curves`), also when the
   run stops early. A CUDA out-of-memory error leaves as :class:`device.CudaOutOfMemory` with
   the figures the planner takes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import structlog
import torch

from forge_kit.objectstore import ObjectStore
from forge_training import cooldown, parallel, precision, schema, validation
from forge_training import device as placement
from forge_training.checkpoint import CheckpointManager, Manifest, optimal_interval_s
from forge_training.collectives import all_reduce, barrier
from forge_training.curves import plot_curves
from forge_training.data import PreparedData, prepare
from forge_training.mfu import peak_flops
from forge_training.objectives import Objective, StepBatch, build_objective
from forge_training.prefetch import Prefetcher
from forge_training.schema import TrainConfig
from forge_training.shm_allreduce import SharedMemoryAllReduce

log = structlog.get_logger(__name__)


@dataclass
class RunContext:
    """Where a run writes and how it is driven; the clock and the stop flag are injected."""

    run_id: str
    run_dir: Path
    store: ObjectStore
    cache_dir: Path
    rank: int = 0
    world_size: int = 1
    clock: Callable[[], float] = time.perf_counter
    should_stop: Callable[[], bool] = lambda: False
    on_published: Callable[[Manifest], None] | None = None
    stop_after_step: int | None = None
    """Return right after this step without saving (tests and benchmarks simulate a kill)."""
    export: bool = True
    device: torch.device | None = None
    """The rank's device (default: :func:`device.select` of the recipe's ``device``)."""
    resume_from: str | None = None
    """Another run's id whose newest checkpoint starts this run when it has none of its own (a
    sweep trial promoted after a pause continues its paused job's state); read only: this run
    checkpoints under ``run_id``."""


@dataclass
class TrainResult:
    """What a run did: ``losses`` maps step (1-based) to the mean training loss."""

    outcome: str
    step: int
    losses: dict[int, float] = field(default_factory=dict)
    val_loss: float | None = None
    val_loss_per_char: float | None = None
    tokens_per_s: float = 0.0
    wall_s: float = 0.0
    export_dir: Path | None = None
    checkpoint_stalls_s: list[float] = field(default_factory=list)
    eval_metrics: dict[str, float] = field(default_factory=dict)
    """The last evaluation's figures (``val_loss`` and the task's own)."""
    mfu: float | None = None
    """Model FLOPs utilisation over the whole run (see :mod:`mfu`)."""
    checkpoint_interval_steps: int = 0
    """The interval in force at the end (Young/Daly: as planned from the measured save)."""
    early_stop: str = ""
    """Why the objective ended training before ``max_steps`` (DPO's over-optimisation monitor)."""
    branch_steps: int = 0
    """Optimizer steps of this run's cooldown branches (:mod:`cooldown`), not in ``step``."""
    memory: dict[str, float] = field(default_factory=dict)
    """This rank's GPU memory high-water marks (:func:`device.memory_figures`; none on a CPU)."""


def lr_factor(config: TrainConfig) -> Callable[[int], float]:
    """Multiplier of the peak LR at step ``s``: linear warmup, then a cosine down to min_lr over
    the rest (``cosine``) or over the last ``decay_fraction`` of the steps (``wsd``)."""
    o = config.optim
    floor = o.min_lr / o.lr
    decay_from = o.warmup_steps
    if o.schedule == "wsd":
        decay_from = max(o.warmup_steps, config.max_steps - round(o.decay_fraction * config.max_steps))

    def factor(step: int) -> float:
        if step < o.warmup_steps:
            return (step + 1) / (o.warmup_steps + 1)
        if step < decay_from:
            return 1.0
        progress = min(1.0, (step - decay_from) / max(1, config.max_steps - decay_from))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def _rng_state(dev: torch.device) -> dict[str, Any]:
    py = random.getstate()
    np_state: tuple[Any, ...] = tuple(np.random.get_state())
    state = {
        "torch": torch.get_rng_state(),
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], torch.from_numpy(np.asarray(np_state[1]).copy()), *np_state[2:]],
    }
    cuda = placement.rng_state(dev)
    if cuda is not None:
        state["cuda"] = cuda
    return state


def _set_rng_state(state: dict[str, Any], dev: torch.device) -> None:
    placement.set_rng_state(state.get("cuda"), dev)
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np_state = state["numpy"]
    np.random.set_state((np_state[0], np_state[1].numpy(), *np_state[2:]))


class _Metrics:
    """``<run dir>/metrics.jsonl`` on rank 0 (other ranks write nothing)."""

    def __init__(self, path: Path, rank: int, started: float, clock: Callable[[], float]) -> None:
        self._file: IO[str] | None = path.open("a") if rank == 0 else None
        self._started, self._clock = started, clock

    def write(self, step: int, values: dict[str, Any]) -> None:
        if self._file is not None:
            line = {"step": step, **values, "time_s": self._clock() - self._started}
            self._file.write(json.dumps(line) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class _SavePlan:
    """When to checkpoint: every ``interval_steps`` (``steps``), or (``young``/``daly``) first at
    ``interval_steps`` after the start, then every interval planned from the measured save."""

    def __init__(self, config: schema.CheckpointConfig, first_step: int) -> None:
        self.config = config
        self.interval = config.interval_steps
        self.next_step = first_step + config.interval_steps
        self.measured = config.interval_policy == "steps"

    def due(self, step: int) -> bool:
        if not self.interval:
            return False
        if self.config.interval_policy == "steps":
            return step % self.interval == 0
        return step >= self.next_step

    def saved(self, step: int) -> None:
        self.next_step = step + self.interval

    def plan(self, save_s: float, step_s: float, step: int) -> dict[str, Any]:
        """Re-plan from the measured save time and step time (the same on every rank)."""
        interval_s = optimal_interval_s(self.config.interval_policy, save_s, self.config.mtbf_s)
        self.interval = max(1, round(interval_s / max(step_s, 1e-9)))
        self.next_step = step + self.interval
        self.measured = True
        return {
            "checkpoint_policy": self.config.interval_policy,
            "checkpoint_save_s": save_s,
            "checkpoint_mtbf_s": self.config.mtbf_s,
            "checkpoint_interval_s": interval_s,
            "checkpoint_interval_steps": self.interval,
            "step_s": step_s,
        }


def _train_step(
    objective: Objective,
    module: torch.nn.Module,
    batch: StepBatch,
    world_size: int,
    dev: torch.device,
    amp: precision.Amp,
) -> tuple[float, list[float]]:
    """Forward/backward every micro-batch; returns this rank's loss sum and figure sums. Each
    micro-batch's summed loss is scaled by the world size, so after the gradient average over
    ranks (DDP's all-reduce, FSDP's reduce-scatter) the gradients are the *sum* over the global
    batch; the loop divides them by the step's global loss units when clipping, once those have
    travelled with the step's figures (one collective a step instead of a second one up front).
    Gradients sync on the last micro-batch only. Each micro-batch goes to ``dev`` (asynchronously,
    from the pinned memory the prefetch thread put it in) and runs forward under ``amp``'s autocast."""
    loss_sum, figures = 0.0, [0.0] * len(objective.figure_names)
    last = len(batch.micro) - 1
    for i, micro in enumerate(batch.micro):
        micro = placement.to_device(micro, dev)
        with parallel.gradient_sync(module, enabled=i == last):
            with amp.autocast():
                loss, figs = objective.loss(module, micro)
            amp.backward(loss * world_size)
        loss_sum += float(loss.detach())
        figures = [a + b for a, b in zip(figures, figs, strict=True)]
    return loss_sum, figures


def param_groups(
    model: torch.nn.Module, optim: schema.OptimConfig, head_prefixes: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """AdamW groups of the trainable parameters: weight decay on matrices only (not on biases and
    norms); a fresh head (names starting with one of ``head_prefixes``) at ``optim.head_lr_scale``
    times the learning rate (when that is not 1: otherwise the two groups of every other run, so
    their checkpoints' optimizer states still load). The body's decayed group comes first (the
    loop logs its rate)."""
    heads = tuple(head_prefixes) if optim.head_lr_scale != 1.0 else ()
    groups: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            key = (bool(heads) and name.startswith(heads), p.dim() < 2)
            groups.setdefault(key, []).append(p)
    return [
        {
            "params": params,
            "lr": optim.lr * (optim.head_lr_scale if is_head else 1.0),
            "weight_decay": 0.0 if exempt else optim.weight_decay,
        }
        for (is_head, exempt), params in sorted(groups.items())
    ]


def train(config: TrainConfig, ctx: RunContext) -> TrainResult:
    """Run (or resume) ``config``; steps 1-6 of the module docstring."""
    # 1. Validate.
    validation.validate(config, ctx.world_size)
    if config.threads:
        torch.set_num_threads(config.threads)
    started = ctx.clock()
    dev = ctx.device or placement.select(config.device)
    placement.bind(dev)
    # 2. Objective: data, model, sampler.
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    np.random.seed(config.seed)
    objective = build_objective(config, ctx.rank, ctx.world_size, ctx.cache_dir)
    model = objective.model
    plain_class = type(model)
    precision.prepare_kernels(model, config.activation_checkpointing, config.compile)
    sharded = parallel.shard(model, config.parallelism, ctx.world_size, dev)
    objective.to(dev)
    amp = precision.Amp(config.precision, dev)
    # 3. Optimizer and schedule.
    o = config.optim
    # The fused kernel (CPU and CUDA) updates every tensor in one pass: 4 ms a step against 13 ms
    # for the per-parameter loop on the CPU baseline's 1.2 M parameters, work every DDP rank repeats.
    optimizer = torch.optim.AdamW(
        param_groups(model, o, objective.head_prefixes()), betas=(o.beta1, o.beta2), fused=True
    )
    trainable = [p for group in optimizer.param_groups for p in group["params"]]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(config))
    ckpt = CheckpointManager(
        ctx.store,
        ctx.run_id,
        rank=ctx.rank,
        world_size=ctx.world_size,
        keep_last=config.checkpoint.keep_last,
        async_save=config.checkpoint.async_save,
        on_published=ctx.on_published,
    )
    ctx.run_dir.mkdir(parents=True, exist_ok=True)
    metrics = _Metrics(ctx.run_dir / "metrics.jsonl", ctx.rank, started, ctx.clock)
    # 4. Resume, or measure the starting point.
    step = 0
    source = ckpt
    manifest = ckpt.latest_manifest()
    if manifest is None and ctx.resume_from and ctx.resume_from != ctx.run_id:
        source = CheckpointManager(ctx.store, ctx.resume_from, rank=ctx.rank, world_size=ctx.world_size)
        manifest = source.latest_manifest()
    if manifest is not None:
        main = source.load_shard(manifest, 0)
        parallel.load_state(model, optimizer, main["model"], main["optimizer"], sharded)
        scheduler.load_state_dict(main["scheduler"])
        objective.sampler.load_state_dict(main["sampler"])
        objective.load_state_dict(main.get("objective", {}))
        amp.load_state_dict(main.get("scaler", {}))
        own = source.load_shard(manifest, ctx.rank) if ctx.rank < manifest.world_size else main
        _set_rng_state(own["rng"], dev)
        step = int(main["step"])
        ckpt.last_published = manifest
        log.info("train.resumed", step=step, manifest=manifest.key, from_world_size=manifest.world_size)
    else:
        with amp.autocast():
            baseline = objective.start()
        if baseline:
            metrics.write(0, baseline)
    position = objective.sampler.state_dict()
    shared = SharedMemoryAllReduce.create(dev) if config.shared_memory_allreduce else None
    module = parallel.replicate(model, sharded, ctx.world_size, shared)
    meta = {
        "recipe": config.name,
        "recipe_hash": config.recipe_hash(),
        "data_hash": objective.data_hash,
        "config": config.to_dict(),
        "data_parallel": "fsdp" if sharded else "ddp" if ctx.world_size > 1 else "none",
        **objective.model_meta(),
    }
    if config.init.parent:
        meta["init_parent"] = config.init.parent

    def save(at: int, figures: dict[str, float]) -> None:
        state: dict[str, Any] = {"step": at, "rng": _rng_state(dev)}
        full = parallel.full_state(model, optimizer, sharded, ctx.rank)
        if full is not None:
            state.update(
                model=full[0],
                optimizer=full[1],
                scheduler=scheduler.state_dict(),
                sampler=position,
                objective=objective.state_dict(),
                tokenizer=objective.tokenizer_json,
                scaler=amp.state_dict(),
            )
        ckpt.save(at, state, {**meta, "metrics": figures})

    result = TrainResult(outcome="succeeded", step=step)
    plan = _SavePlan(config.checkpoint, step)
    peak = peak_flops(config.metrics, dev)
    if peak is None:
        log.warning("mfu.unknown_peak", device=placement.device_name(dev), hint="set metrics.peak_flops")
    else:
        peak *= ctx.world_size
    draw = objective.draw if dev.type != "cuda" else lambda: _pinned(objective.draw(), dev)
    prefetch = Prefetcher(draw, count=config.max_steps - step, depth=config.data.prefetch_batches)
    window_tokens, window_flops, window_start = 0.0, 0.0, ctx.clock()
    loop_start, total_tokens, total_flops, steps_run = window_start, 0.0, 0.0, 0
    last: dict[str, float] = {}
    branches = cooldown.branch_steps(config)

    def evaluate() -> dict[str, float]:
        with amp.autocast():
            return objective.evaluate()

    def branch_step(batch: StepBatch) -> None:
        _train_step(objective, module, batch, ctx.world_size, dev, amp)
        units = all_reduce([batch.units], ctx.world_size, shared=shared)[0]
        amp.unscale(optimizer)
        parallel.clip_grad_norm(trainable, o.grad_clip, scale=1.0 / max(units, 1.0))
        amp.step(optimizer)
        optimizer.zero_grad(set_to_none=True)

    try:
        # 5. Steps.
        while step < config.max_steps:
            batch = prefetch.next()
            loss_sum, figures = _train_step(objective, module, batch, ctx.world_size, dev, amp)
            # One small collective a step, for the loss units, the figures and the preemption
            # flag together: a gloo all-reduce of a few floats costs milliseconds on loopback,
            # latency, not bandwidth; through shared memory, microseconds (load/training/RESULTS.md).
            stop_requested = 1.0 if ctx.should_stop() else 0.0
            units, loss_total, tokens, flops, stop, *figure_sums = all_reduce(
                [batch.units, loss_sum, batch.tokens, batch.flops, stop_requested, *figures],
                ctx.world_size,
                shared=shared,
            )
            amp.unscale(optimizer)
            grad_norm = parallel.clip_grad_norm(trainable, o.grad_clip, scale=1.0 / max(units, 1.0))
            lr = scheduler.get_last_lr()[0]
            amp.step(optimizer)
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step, steps_run, position = step + 1, steps_run + 1, batch.position
            result.losses[step] = loss_total / units
            window_tokens, window_flops = window_tokens + tokens, window_flops + flops
            total_tokens, total_flops = total_tokens + tokens, total_flops + flops
            last = {"loss": result.losses[step], "lr": float(lr), "grad_norm": grad_norm}
            last.update(
                {name: v / units for name, v in zip(objective.figure_names, figure_sums, strict=True)}
            )
            if step % config.log_interval == 0 or step == config.max_steps:
                now = ctx.clock()
                elapsed = max(now - window_start, 1e-9)
                last["tokens_per_s"] = window_tokens / elapsed
                if peak is not None:
                    last["mfu"] = window_flops / elapsed / peak
                last.update(placement.memory_figures(dev))
                window_tokens, window_flops, window_start = 0.0, 0.0, now
                metrics.write(step, last)
            if step % config.eval_interval == 0 or step == config.max_steps:
                result.eval_metrics = evaluate()
                last.update(result.eval_metrics)
                metrics.write(step, result.eval_metrics)
            if step in branches:
                ahead = prefetch.peek(branches[step])
                cooled = cooldown.run_branch(model, optimizer, ahead, branch_step, evaluate)
                result.branch_steps += len(ahead)
                figures_cd = {cooldown.PREFIX + k: v for k, v in cooled.items()}
                metrics.write(step, {**figures_cd, cooldown.STEPS_KEY: len(ahead)})
            early = objective.early_stop(step)
            if early:
                log.info("train.early_stop", step=step, reason=early)
                metrics.write(step, {"early_stopped": 1.0})
                result.early_stop = early
                break
            if ctx.stop_after_step is not None and step >= ctx.stop_after_step:
                ckpt.wait()
                result.outcome, result.step = "stopped", step
                return result
            if stop > 0:
                save(step, last)
                ckpt.wait()
                result.outcome, result.step = "preempted", step
                return result
            if plan.due(step) and step < config.max_steps:
                save(step, last)
                plan.saved(step)
                if not plan.measured:
                    ckpt.wait()  # once: the planned interval needs the whole save's duration
                    own_save_s = ckpt.stats.stalls_s[-1] + ckpt.stats.writes_s[-1]
                    own_step_s = (ctx.clock() - loop_start) / steps_run
                    save_s, step_s = all_reduce([own_save_s, own_step_s], ctx.world_size, op="max")
                    chosen = plan.plan(save_s, step_s, step)
                    log.info("checkpoint.interval", **chosen)
                    metrics.write(step, chosen)
        # 6. Final checkpoint and export.
        elapsed = ctx.clock() - loop_start
        if not result.eval_metrics:
            result.eval_metrics = evaluate()
            last.update(result.eval_metrics)
        if ckpt.last_published is None or ckpt.last_published.step != step:
            save(step, last)
        ckpt.wait()
        result.step = step
        result.wall_s = elapsed
        result.tokens_per_s = total_tokens / max(elapsed, 1e-9)
        result.mfu = total_flops / max(elapsed, 1e-9) / peak if steps_run and peak is not None else None
        result.memory = placement.memory_figures(dev)
        result.val_loss = result.eval_metrics.get("val_loss")
        if result.val_loss is not None and objective.chars_per_token:
            result.val_loss_per_char = result.val_loss / objective.chars_per_token
        result.checkpoint_interval_steps = plan.interval
        if ctx.export:
            exported = parallel.full_model(model, plain_class, sharded, ctx.rank)
            if exported is not None:
                result.export_dir = objective.export(ctx.run_dir / "hf", exported)
        barrier(ctx.world_size)
        return result
    except BaseException as exc:
        if placement.is_out_of_memory(exc):
            report = placement.oom_report(exc, config, dev, ctx.rank, ctx.world_size, model.config)
            raise placement.CudaOutOfMemory(report) from exc
        raise
    finally:
        prefetch.close()
        result.checkpoint_stalls_s = list(ckpt.stats.stalls_s)
        metrics.close()
        if ctx.rank == 0 and (ctx.run_dir / "metrics.jsonl").is_file():
            _draw_curves(ctx.run_dir / "metrics.jsonl")


def _pinned(batch: StepBatch, dev: torch.device) -> StepBatch:
    """``batch`` with its micro-batches in page-locked memory (the prefetch thread's work)."""
    return dataclasses.replace(batch, micro=[placement.pin(m, dev) for m in batch.micro])


def _draw_curves(metrics: Path) -> None:
    """``curves.png`` beside the metrics; a drawing failure is logged, never the run's failure."""
    try:
        plot_curves(metrics)
    except Exception as exc:  # noqa: BLE001 - the picture is a convenience, the metrics are the record
        log.warning("training curves not drawn", metrics=str(metrics), error=repr(exc))


def pretrain(config: TrainConfig, ctx: RunContext) -> TrainResult:
    """:func:`train` for a ``pretrain`` recipe (refuses the other tasks, which need a parent)."""
    if config.task != "pretrain":
        raise schema.RecipeError(f"task: pretrain() runs the 'pretrain' task, got {config.task!r}")
    return train(config, ctx)


def prepared_for(config: TrainConfig, cache_dir: Path) -> PreparedData:
    """The prepared data of ``config`` (for evaluation and sampling outside a run)."""
    return prepare(config.data, cache_dir)
