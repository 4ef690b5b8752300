"""Experiment recipes: Python functions returning a frozen :class:`TrainConfig`.

A recipe is the whole description of a run; overrides are ``dotted.key=value`` pairs applied to
it. :func:`build` refuses unknown keys and :func:`validate` refuses impossible configurations
(heads not dividing the hidden size, a global batch the world size cannot split, a missing or
empty corpus) with a :class:`RecipeError` naming the field, before any worker starts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Where the shared corpora live on Forge machines (``../shared`` next to the repository).
DEFAULT_CORPUS = "/work/shared/data/corpora/tinyshakespeare/input.txt"


class RecipeError(ValueError):
    """A recipe or override that cannot run; the message names the field."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the ``LlamaForCausalLM``; ``vocab_size`` comes from the tokenizer config."""

    hidden_size: int = 128
    intermediate_size: int = 344
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    rope_theta: float = 10000.0


@dataclass(frozen=True)
class DataConfig:
    """Corpus and tokenisation."""

    corpus: str = DEFAULT_CORPUS
    """Path of a UTF-8 text file, or a directory whose ``*.txt`` files are concatenated."""
    vocab_size: int = 512
    """Byte-level BPE vocabulary size (256 byte symbols plus merges)."""
    seq_len: int = 64
    val_fraction: float = 0.1
    """Last fraction of the corpus held out for validation (as nanoGPT does)."""
    shard_tokens: int = 1 << 20
    """Tokens per memmap shard file."""


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup then cosine decay to ``min_lr``."""

    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0


@dataclass(frozen=True)
class CheckpointConfig:
    """When and how checkpoints are written."""

    interval_steps: int = 250
    """Save every this many optimizer steps (0: only at the end and on SIGTERM)."""
    keep_last: int = 3
    async_save: bool = True
    """Serialise and upload in a background thread; the loop stalls only for the in-memory copy."""


@dataclass(frozen=True)
class TrainConfig:
    """One pre-training run. ``global_batch_size`` sequences per optimizer step are split over
    ``world_size`` ranks and ``grad_accum_steps`` micro-batches of ``micro_batch_size``."""

    name: str = "pretrain"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    global_batch_size: int = 12
    micro_batch_size: int = 12
    max_steps: int = 2000
    seed: int = 1337
    eval_interval: int = 250
    eval_batches: int = 20
    log_interval: int = 10
    threads: int = 1
    """torch intra-op threads per process (0: torch's default). One by default: on a shared
    2-core machine two OpenMP threads per process ran 20x slower (0.215 vs 4.1 s/step) when
    other jobs held the cores; data parallelism uses the cores instead."""

    def grad_accum_steps(self, world_size: int) -> int:
        return self.global_batch_size // (world_size * self.micro_batch_size)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def recipe_hash(self) -> str:
        """Identifies the configuration in checkpoint lineage."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def shakespeare_tiny() -> TrainConfig:
    """The CPU baseline: nanoGPT's ``--device=cpu`` shape (4 layers, 4 heads, 128 wide, batch
    12 x 64) on tinyshakespeare with a 512-token byte-level BPE."""
    return TrainConfig(name="shakespeare_tiny")


def smoke() -> TrainConfig:
    """A few seconds of training, for tests and for checking a node end to end."""
    return TrainConfig(
        name="smoke",
        model=ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=2),
        data=DataConfig(vocab_size=300, seq_len=32),
        optim=OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=2),
        checkpoint=CheckpointConfig(interval_steps=5, keep_last=2),
        global_batch_size=4,
        micro_batch_size=2,
        max_steps=10,
        eval_interval=5,
        eval_batches=2,
        log_interval=1,
    )


RECIPES: dict[str, Callable[[], TrainConfig]] = {"shakespeare_tiny": shakespeare_tiny, "smoke": smoke}


def _coerce(current: Any, raw: Any, key: str) -> Any:
    if not isinstance(raw, str):
        return raw
    try:
        if isinstance(current, bool):
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1")
        if isinstance(current, int):
            return int(raw)
        if isinstance(current, float):
            return float(raw)
    except ValueError:
        raise RecipeError(f"{key}: expected {type(current).__name__}, got {raw!r}") from None
    return raw


def _override(obj: Any, parts: list[str], raw: Any, key: str) -> Any:
    names = {f.name for f in dataclasses.fields(obj)}
    if parts[0] not in names:
        raise RecipeError(f"unknown recipe key {key!r} (known here: {', '.join(sorted(names))})")
    current = getattr(obj, parts[0])
    if len(parts) == 1:
        if dataclasses.is_dataclass(current):
            raise RecipeError(f"{key}: is a section, set one of its fields")
        return dataclasses.replace(obj, **{parts[0]: _coerce(current, raw, key)})
    if not dataclasses.is_dataclass(current):
        raise RecipeError(f"unknown recipe key {key!r} ({parts[0]!r} has no fields)")
    return dataclasses.replace(obj, **{parts[0]: _override(current, parts[1:], raw, key)})


def build(recipe: str, overrides: Mapping[str, Any] | None = None) -> TrainConfig:
    """The recipe named ``recipe`` with ``overrides`` (``{"optim.lr": "3e-4"}``) applied."""
    if recipe not in RECIPES:
        raise RecipeError(f"recipe: unknown recipe {recipe!r} (known: {', '.join(sorted(RECIPES))})")
    config = RECIPES[recipe]()
    for key, raw in (overrides or {}).items():
        config = _override(config, key.split("."), raw, key)
    return config


def from_dict(data: Mapping[str, Any]) -> TrainConfig:
    """Rebuild a config from :meth:`TrainConfig.to_dict` output, refusing unknown keys."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, node: Mapping[str, Any]) -> None:
        for k, v in node.items():
            if isinstance(v, Mapping):
                walk(f"{prefix}{k}.", v)
            else:
                flat[f"{prefix}{k}"] = v

    walk("", data)
    config = TrainConfig()
    for key, value in flat.items():
        config = _override(config, key.split("."), value, key)
    return config


def corpus_files(corpus: str) -> list[Path]:
    """The text files of a corpus; raises :class:`RecipeError` when there is nothing to read."""
    path = Path(corpus)
    if path.is_dir():
        files = sorted(p for p in path.glob("*.txt") if p.is_file())
    elif path.is_file():
        files = [path]
    else:
        raise RecipeError(f"data.corpus: {corpus!r} does not exist")
    if not files or all(p.stat().st_size == 0 for p in files):
        raise RecipeError(f"data.corpus: {corpus!r} is empty")
    return files


def validate(config: TrainConfig, world_size: int) -> None:
    """Refuse a configuration that cannot run on ``world_size`` ranks; names the field."""
    m, d, o, c = config.model, config.data, config.optim, config.checkpoint
    positive = {
        "model.hidden_size": m.hidden_size,
        "model.intermediate_size": m.intermediate_size,
        "model.num_layers": m.num_layers,
        "model.num_heads": m.num_heads,
        "model.num_kv_heads": m.num_kv_heads,
        "data.seq_len": d.seq_len,
        "data.shard_tokens": d.shard_tokens,
        "global_batch_size": config.global_batch_size,
        "micro_batch_size": config.micro_batch_size,
        "max_steps": config.max_steps,
        "eval_batches": config.eval_batches,
        "log_interval": config.log_interval,
        "eval_interval": config.eval_interval,
        "checkpoint.keep_last": c.keep_last,
    }
    for key, value in positive.items():
        if value <= 0:
            raise RecipeError(f"{key}: must be positive, got {value}")
    if world_size <= 0:
        raise RecipeError(f"world_size: must be positive, got {world_size}")
    if m.hidden_size % m.num_heads:
        raise RecipeError(f"model.num_heads: {m.num_heads} does not divide model.hidden_size {m.hidden_size}")
    if (m.hidden_size // m.num_heads) % 2:
        raise RecipeError(
            "model.hidden_size / model.num_heads: the head dimension must be even for rotary embeddings"
        )
    if m.num_heads % m.num_kv_heads:
        raise RecipeError(
            f"model.num_kv_heads: {m.num_kv_heads} does not divide model.num_heads {m.num_heads}"
        )
    if d.vocab_size < 257 or d.vocab_size > 65535:
        raise RecipeError(
            f"data.vocab_size: must be in [257, 65535] (byte alphabet + merges, uint16 shards), got {d.vocab_size}"
        )
    if not 0.0 < d.val_fraction < 1.0:
        raise RecipeError(f"data.val_fraction: must be in (0, 1), got {d.val_fraction}")
    if config.global_batch_size % (world_size * config.micro_batch_size):
        raise RecipeError(
            f"global_batch_size: {config.global_batch_size} is not divisible by world_size {world_size} "
            f"x micro_batch_size {config.micro_batch_size}"
        )
    if o.lr <= 0 or o.min_lr < 0 or o.min_lr > o.lr:
        raise RecipeError(f"optim.min_lr/optim.lr: need 0 <= min_lr <= lr and lr > 0, got {o.min_lr}, {o.lr}")
    if o.warmup_steps < 0 or o.warmup_steps >= config.max_steps:
        raise RecipeError(f"optim.warmup_steps: must be in [0, max_steps), got {o.warmup_steps}")
    if o.grad_clip < 0:
        raise RecipeError(f"optim.grad_clip: must be >= 0, got {o.grad_clip}")
    if c.interval_steps < 0:
        raise RecipeError(f"checkpoint.interval_steps: must be >= 0, got {c.interval_steps}")
    corpus_files(d.corpus)
