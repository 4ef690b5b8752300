"""Refusing a recipe configuration that cannot run, before any worker starts: heads not dividing
the hidden size, a global batch the world size cannot split, a missing or empty corpus or pair
set, a parent checkpoint that is missing or corrupt; each :class:`~forge_training.schema.RecipeError`
names the field.
"""

from __future__ import annotations

from pathlib import Path

from forge_kit.paths import resolve_data_path
from forge_training.backbones import BACKBONES, backbone_dir
from forge_training.datafiles import corpus_files, pair_files
from forge_training.schema import (
    DEVICES,
    ENCODER_TASKS,
    INTERVAL_POLICIES,
    LENGTH_BALANCES,
    PARALLELISMS,
    PRECISIONS,
    SCHEDULES,
    TASKS,
    VLM_STAGES,
    DpoMonitorConfig,
    RecipeError,
    TrainConfig,
)


def _validate_monitor(monitor: DpoMonitorConfig) -> None:
    if monitor.interval < 0:
        raise RecipeError(f"dpo.monitor.interval: must be >= 0, got {monitor.interval}")
    if not (Path(monitor.reward_model) / "config.json").is_file():
        raise RecipeError(
            f"dpo.monitor.reward_model: {monitor.reward_model!r} is not a Hugging Face model folder (no config.json)"
        )
    for name, low, high in (("window", 1, 100), ("prompts", 1, 1000), ("max_new_tokens", 1, 1024)):
        value = getattr(monitor, name)
        if not low <= value <= high:
            raise RecipeError(f"dpo.monitor.{name}: must be between {low} and {high}, got {value}")


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
    if o.schedule not in SCHEDULES:
        raise RecipeError(f"optim.schedule: one of {', '.join(SCHEDULES)}, got {o.schedule!r}")
    if not 0.0 <= o.decay_fraction <= 1.0:
        raise RecipeError(f"optim.decay_fraction: must be in [0, 1], got {o.decay_fraction}")
    rc = config.rung_cooldown
    if not 0.0 <= rc.fraction <= 1.0:
        raise RecipeError(f"rung_cooldown.fraction: must be in [0, 1], got {rc.fraction}")
    if rc.fraction > 0 and not 1 <= rc.min_steps < config.max_steps:
        raise RecipeError(
            f"rung_cooldown.min_steps: must be in [1, max_steps) with a fraction, got {rc.min_steps}"
        )
    if not 2 <= rc.eta <= 100:
        raise RecipeError(f"rung_cooldown.eta: must be in [2, 100], got {rc.eta}")
    if o.grad_clip < 0:
        raise RecipeError(f"optim.grad_clip: must be >= 0, got {o.grad_clip}")
    if config.init.encoder_dropout != -1.0 and not 0.0 <= config.init.encoder_dropout < 1.0:
        raise RecipeError(f"init.encoder_dropout: must be -1 or in [0, 1), got {config.init.encoder_dropout}")
    if o.head_lr_scale <= 0:
        raise RecipeError(f"optim.head_lr_scale: must be positive, got {o.head_lr_scale}")
    if c.interval_steps < 0:
        raise RecipeError(f"checkpoint.interval_steps: must be >= 0, got {c.interval_steps}")
    if c.interval_policy not in INTERVAL_POLICIES:
        raise RecipeError(
            f"checkpoint.interval_policy: must be one of {', '.join(INTERVAL_POLICIES)}, got {c.interval_policy!r}"
        )
    if c.interval_policy != "steps":
        if c.mtbf_s <= 0:
            raise RecipeError(f"checkpoint.mtbf_s: must be positive with the {c.interval_policy!r} policy")
        if c.interval_steps <= 0:
            raise RecipeError("checkpoint.interval_steps: must be positive (the first, measured save)")
    if config.parallelism not in PARALLELISMS:
        raise RecipeError(
            f"parallelism: must be one of {', '.join(PARALLELISMS)}, got {config.parallelism!r}"
        )
    if config.precision not in PRECISIONS:
        raise RecipeError(f"precision: must be one of {', '.join(PRECISIONS)}, got {config.precision!r}")
    if config.precision == "fp16" and config.parallelism == "fsdp" and world_size > 1:
        raise RecipeError(
            "precision: fp16 needs loss scaling, which fsdp's sharded gradients do not take; use bf16"
        )
    if config.device not in DEVICES:
        raise RecipeError(f"device: must be one of {', '.join(DEVICES)}, got {config.device!r}")
    if d.prefetch_batches < 0:
        raise RecipeError(f"data.prefetch_batches: must be >= 0, got {d.prefetch_batches}")
    if config.metrics.peak_flops < 0 or config.metrics.cpu_peak_flops_per_thread <= 0:
        raise RecipeError("metrics.peak_flops / metrics.cpu_peak_flops_per_thread: must be positive")
    _validate_task(config)


def _validate_reward(config: TrainConfig) -> None:
    r = config.reward
    if r.length_corr_weight < 0 or r.length_ortho_weight < 0:
        raise RecipeError("reward.length_corr_weight / reward.length_ortho_weight: must be >= 0")
    if config.init.backbone == "parent" and (r.length_head or config.pairs.length_balance != "none"):
        key = "reward.length_head" if r.length_head else "pairs.length_balance"
        raise RecipeError(f"{key}: needs a bundled encoder (init.backbone), not a parent")
    if r.length_head and config.micro_batch_size < 2:
        raise RecipeError(
            "reward.length_head: the length correlation needs micro-batches of at least 2 pairs, "
            f"got micro_batch_size={config.micro_batch_size}"
        )


def _validate_task(config: TrainConfig) -> None:
    """The task's own inputs: corpora, pair files, the parent checkpoint."""
    if config.task not in TASKS:
        raise RecipeError(f"task: must be one of {', '.join(TASKS)}, got {config.task!r}")
    if config.task in ("pretrain", "cpt"):
        corpus_files(config.data.corpus)
    if config.task == "cpt":
        mix = config.mixture
        if not 0.0 < mix.general_fraction < 1.0:
            raise RecipeError(f"mixture.general_fraction: must be in (0, 1), got {mix.general_fraction}")
        corpus_files(mix.general_corpus, "mixture.general_corpus")
    if config.task in ("sft", "reward", "dpo"):
        pair_files(config.pairs.path)
        if config.pairs.extra_train:
            pair_files(config.pairs.extra_train, "pairs.extra_train")
        if not 0.0 <= config.pairs.extra_val_fraction < 1.0:
            raise RecipeError(
                f"pairs.extra_val_fraction: must be in [0, 1), got {config.pairs.extra_val_fraction}"
            )
        if config.pairs.extra_val_fraction and not config.pairs.extra_train:
            raise RecipeError("pairs.extra_val_fraction: needs pairs.extra_train (the pairs to hold out)")
        if config.pairs.length_balance not in LENGTH_BALANCES:
            raise RecipeError(
                f"pairs.length_balance: must be one of {', '.join(LENGTH_BALANCES)}, "
                f"got {config.pairs.length_balance!r}"
            )
        if config.pairs.max_pairs < 0:
            raise RecipeError(f"pairs.max_pairs: must be >= 0, got {config.pairs.max_pairs}")
        if config.data.seq_len < 8:
            raise RecipeError(
                f"data.seq_len: prompt and response need at least 8 tokens, got {config.data.seq_len}"
            )
    if config.task == "reward":
        _validate_reward(config)
    if config.task == "dpo" and config.dpo.beta <= 0:
        raise RecipeError(f"dpo.beta: must be positive, got {config.dpo.beta}")
    if config.task == "dpo" and config.dpo.monitor.interval:
        _validate_monitor(config.dpo.monitor)
    if config.task == "rerank":
        _validate_rerank(config)
    if config.task == "vlm":
        _validate_vlm(config)
        return
    if config.task == "pretrain":
        return
    backbone = config.init.backbone
    if backbone not in BACKBONES:
        raise RecipeError(f"init.backbone: must be one of {', '.join(BACKBONES)}, got {backbone!r}")
    if backbone == "parent" and config.task == "rerank":
        raise RecipeError(
            "init.backbone: the 'rerank' task trains a bundled encoder (e.g. minilm), not a parent"
        )
    if backbone != "parent":
        if config.task not in ENCODER_TASKS:
            raise RecipeError(
                f"init.backbone: only the {' and '.join(ENCODER_TASKS)} tasks start from a bundled encoder, "
                f"not {config.task!r}"
            )
        if config.init.parent:
            raise RecipeError(
                f"init.parent: the {backbone!r} backbone brings its own weights and tokenizer; leave it empty"
            )
        try:
            backbone_dir(backbone)
        except (FileNotFoundError, ValueError) as exc:
            raise RecipeError(f"init.backbone: {exc}") from None
        return
    if not config.init.parent:
        raise RecipeError(
            f"init.parent: the {config.task!r} task starts from a parent checkpoint "
            "(a Hugging Face directory or a Forge manifest.json); none given"
        )
    from forge_training.parents import ParentError, check_parent  # torch: import late

    try:
        check_parent(config.init.parent)
    except ParentError as exc:
        raise RecipeError(f"init.parent: {exc}") from None


def _validate_rerank(config: TrainConfig) -> None:
    r = config.rerank
    for key, value in {
        "rerank.groups_per_dataset": r.groups_per_dataset,
        "rerank.negatives": r.negatives,
        "rerank.negative_depth": r.negative_depth,
    }.items():
        if value <= 0:
            raise RecipeError(f"{key}: must be positive, got {value}")
    if r.negative_depth < r.negatives:
        raise RecipeError(
            f"rerank.negative_depth: {r.negative_depth} cannot yield {r.negatives} negatives (rerank.negatives)"
        )
    if r.positive_depth < 0:
        raise RecipeError(f"rerank.positive_depth: must be >= 0, got {r.positive_depth}")
    if config.data.seq_len < 16:
        raise RecipeError(
            f"data.seq_len: a query and a passage need at least 16 tokens, got {config.data.seq_len}"
        )
    if not r.names():
        raise RecipeError("rerank.datasets: names no dataset")
    for name in r.names():
        folder = resolve_data_path(r.root) / name
        for part in ("corpus.jsonl", "queries.jsonl", "qrels/train.tsv"):
            if not (folder / part).is_file():
                raise RecipeError(
                    f"rerank.datasets: {str(folder)!r} has no {part} (a BEIR folder with a train split)"
                )


def _validate_vlm(config: TrainConfig) -> None:
    v = config.vlm
    if v.stage not in VLM_STAGES:
        raise RecipeError(f"vlm.stage: must be one of {', '.join(VLM_STAGES)}, got {v.stage!r}")
    if v.image_size <= 0 or v.patch_size <= 0 or v.image_size % v.patch_size:
        raise RecipeError(f"vlm.patch_size: {v.patch_size} must divide vlm.image_size {v.image_size}")
    if v.vision_hidden_size % v.vision_heads or min(v.vision_layers, v.vision_heads, v.eval_items) <= 0:
        raise RecipeError(
            "vlm.vision_heads: must divide vlm.vision_hidden_size (layers, heads, eval_items positive)"
        )
    if not 0.0 <= v.text_replay < 1.0:
        raise RecipeError(f"vlm.text_replay: must be in [0, 1), got {v.text_replay}")
    if not 0.0 <= v.caption_replay < 1.0 - v.text_replay:
        raise RecipeError(
            f"vlm.caption_replay: must be in [0, 1 - text_replay), got {v.caption_replay} with text_replay {v.text_replay}"
        )
    if v.stage == "interleave" and v.text_replay <= 0:
        raise RecipeError("vlm.text_replay: the interleave stage mixes text-only replay; must be > 0")
    if v.from_scratch and v.stage != "joint":
        raise RecipeError("vlm.from_scratch: only the joint stage trains from scratch")
    if v.world != "synthetic" and not resolve_data_path(v.world).is_dir():
        raise RecipeError(f"vlm.world: {v.world!r} is not a folder (or 'synthetic')")
    if config.data.seq_len < 2 * (v.image_size // v.patch_size) ** 2:
        raise RecipeError(f"data.seq_len: {config.data.seq_len} leaves no room beside an image's tokens")
    if not config.init.parent:
        raise RecipeError(
            "init.parent: the 'vlm' task starts from a causal LM (align, joint) or a VLM; none given"
        )
    from forge_training.parents import ParentError, check_parent  # torch: import late
    from forge_training.vlm.parent import check_vlm_parent

    try:
        (check_parent if v.stage in ("align", "joint") else check_vlm_parent)(config.init.parent)
    except ParentError as exc:
        raise RecipeError(f"init.parent: {exc}") from None
