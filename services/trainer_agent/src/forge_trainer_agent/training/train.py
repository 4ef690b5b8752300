"""The pre-training loop: ``LlamaForCausalLM``, AdamW, warmup + cosine, clipping, accumulation,
DistributedDataParallel over whatever process group is initialised (gloo on CPU, NCCL on GPU).

:func:`pretrain` runs these steps:

1. validate the recipe for this world size (before any work);
2. prepare the token shards (rank 0; the others wait at a barrier);
3. build model, optimizer and schedule from the seed; wrap in DDP when ``world_size > 1``;
4. resume from the newest complete checkpoint, if any (model, optimizer, schedule, RNG, sampler);
5. for each step: read this rank's slice of the global batch, forward/backward per micro-batch
   (gradient sync only on the last), clip, step, log metrics; evaluate and checkpoint on their
   intervals; on a stop request (SIGTERM) checkpoint and return ``preempted``;
6. at the end: final checkpoint, wait for it to publish, export in Hugging Face format.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils import clip_grad_norm_
from transformers import LlamaConfig, LlamaForCausalLM

from forge_kit.objectstore import ObjectStore
from forge_trainer_agent.training import recipes
from forge_trainer_agent.training.checkpoint import CheckpointManager, Manifest
from forge_trainer_agent.training.data import (
    EOT,
    PreparedData,
    SamplerState,
    StepSampler,
    TokenShards,
    prepare,
)
from forge_trainer_agent.training.export import export_hf
from forge_trainer_agent.training.recipes import TrainConfig

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


def model_config(config: TrainConfig, vocab_size: int, bos_eos: int) -> LlamaConfig:
    m = config.model
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        max_position_embeddings=config.data.seq_len,
        rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
        bos_token_id=bos_eos,
        eos_token_id=bos_eos,
        pad_token_id=bos_eos,
        tie_word_embeddings=False,
    )


def lr_factor(config: TrainConfig) -> Callable[[int], float]:
    """Multiplier of the peak LR at step ``s``: linear warmup, then cosine down to min_lr."""
    o = config.optim
    floor = o.min_lr / o.lr

    def factor(step: int) -> float:
        if step < o.warmup_steps:
            return (step + 1) / (o.warmup_steps + 1)
        progress = min(1.0, (step - o.warmup_steps) / max(1, config.max_steps - o.warmup_steps))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def _rng_state() -> dict[str, Any]:
    py = random.getstate()
    np_state: tuple[Any, ...] = tuple(np.random.get_state())
    return {
        "torch": torch.get_rng_state(),
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], torch.from_numpy(np.asarray(np_state[1]).copy()), *np_state[2:]],
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np_state = state["numpy"]
    np.random.set_state((np_state[0], np_state[1].numpy(), *np_state[2:]))


def _batch(split: TokenShards, windows: list[int], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.stack([split.window(i, seq_len) for i in windows])
    data = torch.from_numpy(rows)
    return data[:, :-1], data[:, 1:]


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def _all_reduce_sum(values: list[float], world_size: int) -> list[float]:
    if world_size == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return [float(v) for v in t.tolist()]


@torch.no_grad()
def evaluate(
    model: LlamaForCausalLM, val: TokenShards, config: TrainConfig, rank: int, world_size: int
) -> float:
    """Mean per-token loss on a fixed, evenly spread set of validation windows (split by rank)."""
    count = config.eval_batches * config.micro_batch_size
    n = val.num_windows(config.data.seq_len)
    windows = [int(i) for i in np.linspace(0, n - 1, min(count, n)).astype(np.int64)]
    mine = windows[rank::world_size]
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    for start in range(0, len(mine), config.micro_batch_size):
        x, y = _batch(val, mine[start : start + config.micro_batch_size], config.data.seq_len)
        total += float(_loss(model, x, y)) * y.numel()
        tokens += y.numel()
    model.train(was_training)
    total, tokens_f = _all_reduce_sum([total, float(tokens)], world_size)
    return total / tokens_f


def _barrier(world_size: int) -> None:
    if world_size > 1:
        dist.barrier()


def pretrain(config: TrainConfig, ctx: RunContext) -> TrainResult:
    """Run (or resume) ``config``; steps 1-6 of the module docstring."""
    # 1. Validate.
    recipes.validate(config, ctx.world_size)
    if config.threads:
        torch.set_num_threads(config.threads)
    started = ctx.clock()
    # 2. Data.
    if ctx.rank == 0:
        prepared = prepare(config.data, ctx.cache_dir)
    _barrier(ctx.world_size)
    if ctx.rank != 0:
        prepared = prepare(config.data, ctx.cache_dir)
    train_split, val_split = prepared.split("train"), prepared.split("val")
    tok = prepared.tokenizer()
    eot = tok.token_to_id(EOT)
    if eot is None:
        raise RuntimeError(f"the tokenizer in {prepared.root} has no {EOT} token")
    # 3. Model, optimizer, schedule.
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    np.random.seed(config.seed)
    model = LlamaForCausalLM(model_config(config, tok.get_vocab_size(), eot))
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    o = config.optim
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        foreach=False,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(config))
    seq_len = config.data.seq_len
    sampler = StepSampler(train_split.num_windows(seq_len), config.global_batch_size, config.seed)
    ckpt = CheckpointManager(
        ctx.store,
        ctx.run_id,
        rank=ctx.rank,
        world_size=ctx.world_size,
        keep_last=config.checkpoint.keep_last,
        async_save=config.checkpoint.async_save,
        on_published=ctx.on_published,
    )
    # 4. Resume.
    step = 0
    manifest = ckpt.latest_manifest()
    if manifest is not None:
        main = ckpt.load_shard(manifest, 0)
        model.load_state_dict(main["model"])
        optimizer.load_state_dict(main["optimizer"])
        scheduler.load_state_dict(main["scheduler"])
        sampler.state = SamplerState(**main["sampler"])
        own = ckpt.load_shard(manifest, ctx.rank) if ctx.rank < manifest.world_size else main
        _set_rng_state(own["rng"])
        step = int(main["step"])
        ckpt.last_published = manifest
        log.info("train.resumed", step=step, manifest=manifest.key, from_world_size=manifest.world_size)
    ddp: torch.nn.Module = DistributedDataParallel(model) if ctx.world_size > 1 else model
    accum = config.grad_accum_steps(ctx.world_size)
    meta = {"recipe": config.name, "recipe_hash": config.recipe_hash(), "data_hash": prepared.data_hash}

    def save(at: int, metrics: dict[str, float]) -> None:
        state: dict[str, Any] = {"step": at, "rng": _rng_state()}
        if ctx.rank == 0:
            state.update(
                model=model.state_dict(),
                optimizer=optimizer.state_dict(),
                scheduler=scheduler.state_dict(),
                sampler={"epoch": sampler.state.epoch, "cursor": sampler.state.cursor},
            )
        ckpt.save(at, state, {**meta, "metrics": metrics})

    ctx.run_dir.mkdir(parents=True, exist_ok=True)
    metrics_file = (ctx.run_dir / "metrics.jsonl").open("a") if ctx.rank == 0 else None
    result = TrainResult(outcome="succeeded", step=step)
    tokens_per_step = config.global_batch_size * seq_len
    window_tokens, window_start = 0, ctx.clock()
    loop_start = window_start
    last: dict[str, float] = {}
    try:
        # 5. Steps.
        while step < config.max_steps:
            windows = sampler.next_step(ctx.rank, ctx.world_size)
            loss_sum = 0.0
            for micro in range(accum):
                part = windows[micro * config.micro_batch_size : (micro + 1) * config.micro_batch_size]
                x, y = _batch(train_split, part, seq_len)
                sync = micro == accum - 1 or not isinstance(ddp, DistributedDataParallel)
                if sync:
                    loss = _loss(ddp, x, y)
                    (loss / accum).backward()
                else:
                    with ddp.no_sync():  # type: ignore[operator]
                        loss = _loss(ddp, x, y)
                        (loss / accum).backward()
                loss_sum += float(loss.detach())
            grad_norm = float(
                clip_grad_norm_(model.parameters(), o.grad_clip if o.grad_clip > 0 else float("inf"))
            )
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            (mean_loss,) = _all_reduce_sum([loss_sum / accum], ctx.world_size)
            mean_loss /= ctx.world_size
            result.losses[step] = mean_loss
            window_tokens += tokens_per_step
            last = {"loss": mean_loss, "lr": float(lr), "grad_norm": grad_norm}
            if step % config.log_interval == 0 or step == config.max_steps:
                now = ctx.clock()
                last["tokens_per_s"] = window_tokens / max(now - window_start, 1e-9)
                window_tokens, window_start = 0, now
                if metrics_file is not None:
                    metrics_file.write(json.dumps({"step": step, **last, "time_s": now - started}) + "\n")
                    metrics_file.flush()
            if step % config.eval_interval == 0 or step == config.max_steps:
                result.val_loss = evaluate(model, val_split, config, ctx.rank, ctx.world_size)
                last["val_loss"] = result.val_loss
                if metrics_file is not None:
                    metrics_file.write(json.dumps({"step": step, "val_loss": result.val_loss}) + "\n")
                    metrics_file.flush()
            if ctx.stop_after_step is not None and step >= ctx.stop_after_step:
                ckpt.wait()
                result.outcome, result.step = "stopped", step
                return result
            (stop,) = _all_reduce_sum([1.0 if ctx.should_stop() else 0.0], ctx.world_size)
            if stop > 0:
                save(step, last)
                ckpt.wait()
                result.outcome, result.step = "preempted", step
                return result
            if (
                config.checkpoint.interval_steps
                and step % config.checkpoint.interval_steps == 0
                and step < config.max_steps
            ):
                save(step, last)
        # 6. Final checkpoint and export.
        elapsed = ctx.clock() - loop_start
        if ckpt.last_published is None or ckpt.last_published.step != step:
            save(step, last)
        ckpt.wait()
        result.step = step
        result.wall_s = elapsed
        result.tokens_per_s = tokens_per_step * len(result.losses) / max(elapsed, 1e-9)
        if result.val_loss is None:
            result.val_loss = evaluate(model, val_split, config, ctx.rank, ctx.world_size)
        result.val_loss_per_char = result.val_loss / val_split.chars_per_token
        if ctx.export and ctx.rank == 0:
            result.export_dir = export_hf(model, prepared.tokenizer_path, ctx.run_dir / "hf")
        _barrier(ctx.world_size)
        return result
    finally:
        result.checkpoint_stalls_s = list(ckpt.stats.stalls_s)
        if metrics_file is not None:
            metrics_file.close()


def prepared_for(config: TrainConfig, cache_dir: Path) -> PreparedData:
    """The prepared data of ``config`` (for evaluation and sampling outside a run)."""
    return prepare(config.data, cache_dir)
