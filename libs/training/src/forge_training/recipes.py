"""Experiment recipes: Python functions returning a frozen :class:`TrainConfig`.

A recipe is the whole description of a run; overrides are ``dotted.key=value`` pairs applied to
it. :func:`build` refuses unknown keys (and keys of sections the recipe's task does not read) and
:func:`validate` refuses impossible configurations (heads not dividing the hidden size, a global
batch the world size cannot split, a missing or empty corpus or pair set, a parent checkpoint that
is missing or corrupt) with a :class:`RecipeError` naming the field, before any worker starts.

Tasks (``TrainConfig.task``): ``pretrain`` (from scratch, own tokenizer), ``cpt`` (continual
pre-training on a domain corpus mixed with general data), ``sft`` (prompt/response pairs, loss on
the response), ``reward`` (scalar head, Bradley-Terry on chosen/rejected pairs) and ``dpo``
(against the frozen parent). Every task but ``pretrain`` starts from ``init.parent``, except a
``reward`` run with ``init.backbone=minilm``: a bundled BERT encoder (see :mod:`backbones`) under a
new scalar head, with its own WordPiece tokenizer (``reward_hh_minilm``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forge_kit.paths import resolve_data_path
from forge_training.backbones import BACKBONES, backbone_dir

# Data paths: absolute, or relative to the data folder (FORGE_DATA_DIR, filled by `forge data fetch`).
#: The pre-training corpus: 1.1 MB of Shakespeare.
DEFAULT_CORPUS = "corpora/tinyshakespeare/input.txt"
#: A domain corpus for continual pre-training: 5,183 scientific abstracts (BEIR SciFact).
SCIFACT_CORPUS = "beir/scifact/corpus.jsonl"
#: Anthropic HH-RLHF chosen/rejected pairs (helpful-base and harmless-base test splits).
HH_RLHF = "preferences/hh-rlhf"
#: BEIR datasets (corpus.jsonl, queries.jsonl, qrels/{train,dev,test}.tsv per folder).
BEIR = "beir"

TASKS = ("pretrain", "cpt", "sft", "reward", "dpo", "rerank")
#: Tasks that may start from a bundled encoder (``init.backbone``) instead of a parent.
ENCODER_TASKS = ("reward", "rerank")
INTERVAL_POLICIES = ("steps", "young", "daly")
PARALLELISMS = ("ddp", "fsdp")
#: ``pairs.length_balance`` values (``reward`` only).
LENGTH_BALANCES = ("none", "reweight", "subsample")


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
    text_fields: str = "title,text"
    """For a ``.jsonl``/``.jsonl.gz`` corpus: comma-separated fields of each line that form a
    document (documents are separated by a blank line)."""
    prefetch_batches: int = 2
    """Steps of batches a background thread prepares ahead of the loop (0: none). The checkpoint
    holds the position of the last *consumed* step, so read-ahead never shifts a resume."""


@dataclass(frozen=True)
class InitConfig:
    """Where a run's weights and tokenizer come from (every task but ``pretrain``)."""

    parent: str = ""
    """A Hugging Face directory (``config.json``, ``model.safetensors``, ``tokenizer.json``) or a
    Forge manifest (``.../checkpoints/<run>/step-<n>/manifest.json``, a path or object-store URL)."""
    backbone: str = "parent"
    """``parent`` (the model of ``parent``) or, for the ``reward`` and ``rerank`` tasks, a bundled
    encoder: ``minilm`` = sentence-transformers/all-MiniLM-L6-v2 (``BertForSequenceClassification``,
    one label, the head new; its WordPiece tokenizer; ``parent`` must then be empty)."""
    encoder_dropout: float = -1.0
    """Dropout of a bundled encoder (hidden and attention probabilities); -1 keeps its own (0.1
    for MiniLM). 0 makes a step deterministic given the batch, so runs on different numbers of
    processes train alike."""
    freeze_embeddings: bool = False
    """Keep the input (word-piece) embedding table as it was loaded: for a bundled encoder about
    half its weights, a tenth of the step time, and words the training data never shows keep
    their pre-trained meaning."""


@dataclass(frozen=True)
class MixtureConfig:
    """Continual pre-training: general data replayed next to the domain corpus (``data.corpus``)."""

    general_corpus: str = DEFAULT_CORPUS
    """The general (parent's pre-training) corpus; its validation split measures forgetting."""
    general_fraction: float = 0.1
    """Sampling weight of the general data: each sequence of a batch is general with this
    probability (5-20 % is the usual replay range)."""


@dataclass(frozen=True)
class PairsConfig:
    """Prompt/response data for ``sft``, ``reward`` and ``dpo``: HH-RLHF style ``{"chosen",
    "rejected"}`` transcripts; the prompt is the shared prefix up to the last Assistant turn."""

    path: str = HH_RLHF
    """A ``.jsonl``/``.jsonl.gz`` file, or a directory searched recursively for them."""
    max_pairs: int = 0
    """Use at most this many pairs after filtering and the seeded shuffle (0: all)."""
    extra_train: str = ""
    """More pairs for training only (a file or a directory, like ``path``; empty: none). They are
    never held out, and one whose opening user turn is also a held-out pair's is dropped."""
    exclude_shared_openings: bool = False
    """Drop from training every pair whose opening user turn is also a held-out pair's (HH-RLHF
    has distinct conversations that start alike: 147 of helpful-base's 2,339 pairs share their
    opening with another), so no held-out conversation is even partly trained on."""
    length_balance: str = "none"
    """``reward`` only: how training pairs are balanced between those whose chosen reply is the
    longer one and those where it is the shorter one (lengths in words, :mod:`forge_kit.rmlength`):
    ``none``, ``reweight`` (each of the two groups carries half of the loss; tied pairs weigh 1)
    or ``subsample`` (the larger group is cut, seeded, to the size of the smaller)."""


@dataclass(frozen=True)
class RerankConfig:
    """Cross-encoder training for the reranker (``rerank``): groups of (query, one relevant
    passage, ``negatives`` BM25 hard negatives) from BEIR **train** qrels, listwise loss."""

    root: str = BEIR
    """Folder holding one BEIR folder per dataset."""
    datasets: str = "scifact,nfcorpus"
    """Comma-separated dataset folders under ``root``; each needs ``qrels/train.tsv``."""
    groups_per_dataset: int = 2000
    """Most training groups drawn from each dataset (held-out queries' groups not counted)."""
    negatives: int = 3
    """Hard negatives per group."""
    negative_depth: int = 30
    """Hard negatives come from the BM25 top ``negative_depth`` less the judged-relevant documents."""
    positive_depth: int = 100
    """Only relevant documents in the BM25 top ``positive_depth`` of their query are positives
    (0: every judged document). The reranker only ever sees first-stage candidates, and NFCorpus
    judges about 31 documents per train query, most linked to it only indirectly: drawn at random,
    the positive was in the BM25 top 30 for 15 % of its groups, half the groups taught the
    opposite of the SciFact half, and the loss stayed at chance."""

    resample_negatives: bool = True
    """Draw each group's negatives again from its query's top-``negative_depth`` pool in every
    epoch after the first (seeded by seed, epoch and group, so resume is exact)."""

    def names(self) -> list[str]:
        return [n.strip() for n in self.datasets.split(",") if n.strip()]


@dataclass(frozen=True)
class RewardConfig:
    """``reward`` on a bundled encoder: the ODIN length head (Chen et al. 2024, "ODIN:
    Disentangled Reward Mitigates Hacking in RLHF"), see :mod:`lengthdebias`."""

    length_head: bool = False
    """Train two scores on the pooled output, quality and length, whose sum is the Bradley-Terry
    reward; the length score is pushed to correlate with the reply's length, the quality score
    away from it, and their weight vectors to be orthogonal. Only the quality score is exported."""
    length_corr_weight: float = 1.0
    """Weight of ``|corr(quality, length)| - corr(length score, length)`` over each micro-batch."""
    length_ortho_weight: float = 1.0
    """Weight of ``|w_quality . w_length|``, the two heads' weight vectors' dot product."""


@dataclass(frozen=True)
class DpoMonitorConfig:
    """Over-optimisation watched during DPO (``dpo_monitor.py``): off while ``interval`` is 0."""

    interval: int = 0
    """Score KL, proxy reward and held-out agreement every this many steps."""
    reward_model: str = ""
    """The pinned reward model: a Hugging Face sequence-classification folder (same tokenizer)."""
    window: int = 2
    """Stop when the proxy reward rose and held-out agreement fell over this many checks."""
    prompts: int = 8
    """Held-out prompts sampled at each check."""
    max_new_tokens: int = 16
    out: str = ""
    """Where the trace is written as JSON (a path or object-store URL); empty: not written."""


@dataclass(frozen=True)
class DpoConfig:
    """Direct preference optimisation (sigmoid loss) against the frozen parent."""

    beta: float = 0.1
    """Strength of the implicit KL penalty: reward = beta * (log pi - log pi_ref)."""
    monitor: DpoMonitorConfig = DpoMonitorConfig()


@dataclass(frozen=True)
class MetricsConfig:
    """What the MFU estimate divides by."""

    peak_flops: float = 0.0
    """Peak FLOP/s of one process's device (0: the GPU's dense bf16 peak from a table, or on CPU
    ``cpu_peak_flops_per_thread`` x the process's torch threads)."""
    cpu_peak_flops_per_thread: float = 1.0e11
    """About one AVX2 core at 3 GHz: 2 FMA units x 8 fp32 lanes x 2 FLOP x 3e9 = 96 GFLOP/s.
    Set it from a measured ``torch.mm`` rate for a meaningful CPU MFU."""


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
    head_lr_scale: float = 1.0
    """Learning-rate multiplier of a freshly initialised head on a bundled encoder (its pooler
    and one-output classifier). AdamW moves each weight by about the learning rate per step, so a
    classifier initialised at std 0.02 over pooled values of about ±0.05 needs thousands of steps
    at an encoder's fine-tuning rate before the scores of a group differ at all."""


@dataclass(frozen=True)
class CheckpointConfig:
    """When and how checkpoints are written."""

    interval_steps: int = 250
    """Save every this many optimizer steps (0: only at the end and on SIGTERM). With the
    ``young``/``daly`` policies: the step of the first save, which measures the save time."""
    interval_policy: str = "steps"
    """``steps`` (every ``interval_steps``), ``young`` (sqrt(2 x save time x MTBF)) or ``daly``
    (Daly's higher-order refinement), re-evaluated after the first measured save."""
    mtbf_s: float = 0.0
    """Mean time between failures of the whole job, seconds (``young``/``daly``)."""
    keep_last: int = 3
    async_save: bool = True
    """Serialise and upload in a background thread; the loop stalls only for the in-memory copy."""


@dataclass(frozen=True)
class TrainConfig:
    """One pre-training run. ``global_batch_size`` sequences per optimizer step are split over
    ``world_size`` ranks and ``grad_accum_steps`` micro-batches of ``micro_batch_size``."""

    name: str = "pretrain"
    task: str = "pretrain"
    """One of :data:`TASKS`."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    init: InitConfig = field(default_factory=InitConfig)
    mixture: MixtureConfig = field(default_factory=MixtureConfig)
    pairs: PairsConfig = field(default_factory=PairsConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    rerank: RerankConfig = field(default_factory=RerankConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    global_batch_size: int = 12
    micro_batch_size: int = 12
    max_steps: int = 2000
    seed: int = 1337
    eval_interval: int = 250
    eval_batches: int = 20
    log_interval: int = 10
    parallelism: str = "ddp"
    """Data parallelism over the ranks: ``ddp`` (DistributedDataParallel, full replicas) or
    ``fsdp`` (``fully_shard`` per transformer block, then the root: parameters, gradients and
    optimizer state sharded over the ranks). One process trains unwrapped either way."""
    shared_memory_allreduce: bool = True
    """On CPU ranks of one host, sum the gradients (under ``ddp``) and each step's figures through
    shared memory rather than gloo's loopback TCP (the same sums, several times faster). Off:
    gloo's all-reduce, as across hosts."""
    threads: int = 1
    """torch intra-op threads per process (0: torch's default). One by default: OpenMP threads
    that outnumber the free cores slow a step down many times when other jobs hold the cores;
    data parallelism uses the cores instead."""

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


def cpt_scifact() -> TrainConfig:
    """Continual pre-training of a Shakespeare model on scientific abstracts (BEIR SciFact) with
    10 % of the batch replaying Shakespeare: peak LR 3x lower than pre-training, 20 warmup steps;
    ``general_val_loss`` (forgetting) is logged next to the domain ``val_loss``."""
    return TrainConfig(
        name="cpt_scifact",
        task="cpt",
        data=DataConfig(corpus=SCIFACT_CORPUS, seq_len=64),
        optim=OptimConfig(lr=3e-4, min_lr=3e-5, warmup_steps=20),
        mixture=MixtureConfig(general_corpus=DEFAULT_CORPUS, general_fraction=0.1),
        max_steps=500,
        eval_interval=100,
    )


def _pairs_recipe(name: str, task: str, lr: float, max_steps: int) -> TrainConfig:
    return TrainConfig(
        name=name,
        task=task,
        data=DataConfig(seq_len=128),
        optim=OptimConfig(lr=lr, min_lr=lr / 10, warmup_steps=10, weight_decay=0.0),
        checkpoint=CheckpointConfig(interval_steps=100),
        global_batch_size=8,
        micro_batch_size=8,
        max_steps=max_steps,
        eval_interval=100,
        eval_batches=60,  # 480 held-out pairs: the whole 10 % of HH-RLHF's 4.6k test pairs
    )


def sft_hh() -> TrainConfig:
    """Supervised fine-tuning on HH-RLHF chosen conversations in the chat template, loss on the
    final Assistant response only."""
    return _pairs_recipe("sft_hh", "sft", lr=3e-4, max_steps=300)


def reward_hh() -> TrainConfig:
    """Reward model on HH-RLHF: the parent with a scalar head (``LlamaForSequenceClassification``,
    one label), Bradley-Terry loss; held-out pairwise accuracy with its 95 % Wilson interval."""
    return _pairs_recipe("reward_hh", "reward", lr=1e-4, max_steps=300)


def reward_hh_minilm() -> TrainConfig:
    """Reward model from a pre-trained encoder: all-MiniLM-L6-v2 (``init.backbone=minilm``) under a
    new one-output head (``BertForSequenceClassification``, read at ``[CLS]``), its own WordPiece
    tokenizer, Bradley-Terry loss; held-out pairwise accuracy with its 95 % Wilson interval.

    Each sequence is ``[CLS] prompt + response [SEP]`` cut from the left to ``data.seq_len`` (256)
    tokens, so the final Assistant response survives (80 % of helpful-base sequences fit whole).
    The split: helpful-base's 2,339 usable pairs shuffled by ``seed``, the last 30 % (701) held
    out; training takes the other 1,638 less the 62 whose opening user turn a held-out pair shares
    (1,576). Harmless-base is not mixed in by default (``pairs.extra_train`` adds it): its chosen
    response is the longer one in 44 % of pairs, helpful-base's in 59 %, so it pulls a small model
    away from what helpful-base rewards. Micro-batches of 2 pairs keep padding low (a batch pads
    to its longest sequence); 16 pairs per step. The new head (pooler and classifier) learns 20x
    faster than the encoder (``optim.head_lr_scale``, as the reranker's cross-encoder), which
    held out better than 1x (``load/training/RESULTS.md``)."""
    return TrainConfig(
        name="reward_hh_minilm",
        task="reward",
        init=InitConfig(backbone="minilm"),
        data=DataConfig(seq_len=256, val_fraction=0.3),
        pairs=PairsConfig(path=f"{HH_RLHF}/helpful-base", exclude_shared_openings=True),
        optim=OptimConfig(lr=8e-5, min_lr=8e-6, warmup_steps=25, weight_decay=0.01, head_lr_scale=20.0),
        checkpoint=CheckpointConfig(interval_steps=50, keep_last=2),
        global_batch_size=16,
        micro_batch_size=2,
        max_steps=140,  # 2,240 pairs, 1.4 epochs
        eval_interval=140,
        eval_batches=351,  # 351 x 2 = 702 >= the 701 held-out pairs: every one is scored
        log_interval=5,
        threads=1,  # 2 on an idle machine: with another job on the cores, 2 threads ran 3x slower
    )


def dpo_hh() -> TrainConfig:
    """DPO (sigmoid loss, beta 0.1) on HH-RLHF pairs against the frozen parent."""
    return _pairs_recipe("dpo_hh", "dpo", lr=5e-5, max_steps=300)


def rerank_beir_minilm() -> TrainConfig:
    """The reranker's cross-encoder: all-MiniLM-L6-v2 (``init.backbone=minilm``) under a new
    one-output head, fine-tuned on the **train** qrels of SciFact and NFCorpus with 3 BM25 hard
    negatives per relevant passage (see :class:`RerankConfig`); listwise softmax cross-entropy
    over each group (as localized contrastive estimation). ``data.val_fraction`` of each
    dataset's train queries are held out: their groups give the held-out loss and how often the
    relevant passage ranks first of its group. 128 word pieces per pair keep the query, the title
    and the abstract's opening at about 1.5x the pairs/s of 192 on CPU; 4 groups (16 pairs) a
    step, since on CPU pairs/s hardly grow with the batch and the fresh head needs many steps;
    the word-piece embeddings stay frozen and the head learns 20x faster."""
    return TrainConfig(
        name="rerank_beir_minilm",
        task="rerank",
        init=InitConfig(backbone="minilm", freeze_embeddings=True),
        data=DataConfig(seq_len=128, val_fraction=0.1),
        optim=OptimConfig(lr=7e-5, min_lr=0.0, warmup_steps=30, weight_decay=0.01, head_lr_scale=20.0),
        checkpoint=CheckpointConfig(interval_steps=100, keep_last=2),
        global_batch_size=4,
        micro_batch_size=2,  # so that 1 or 2 processes can share a step
        max_steps=300,
        eval_interval=150,
        eval_batches=100,  # 100 x 2 = 200 held-out groups
        log_interval=10,
        threads=1,
    )


RECIPES: dict[str, Callable[[], TrainConfig]] = {
    "shakespeare_tiny": shakespeare_tiny,
    "smoke": smoke,
    "cpt_scifact": cpt_scifact,
    "sft_hh": sft_hh,
    "reward_hh": reward_hh,
    "reward_hh_minilm": reward_hh_minilm,
    "dpo_hh": dpo_hh,
    "rerank_beir_minilm": rerank_beir_minilm,
}

#: What the tasks that start from a parent or an encoder ignore: the model shape, the tokenizer
#: training and the corpus of language modelling.
_NO_CORPUS = ("model", "data.corpus", "data.vocab_size", "data.shard_tokens", "data.text_fields", "mixture")
#: Keys each task ignores; setting one is refused like an unknown key.
_UNUSED: dict[str, tuple[str, ...]] = {
    "pretrain": ("init", "mixture", "pairs", "reward", "dpo", "rerank", "optim.head_lr_scale"),
    "cpt": ("model", "data.vocab_size", "pairs", "reward", "dpo", "rerank", "optim.head_lr_scale"),
    "sft": (*_NO_CORPUS, "pairs.length_balance", "reward", "dpo", "rerank", "optim.head_lr_scale"),
    "reward": (*_NO_CORPUS, "dpo", "rerank"),
    "dpo": (*_NO_CORPUS, "pairs.length_balance", "reward", "rerank", "optim.head_lr_scale"),
    "rerank": (*_NO_CORPUS, "pairs", "reward", "dpo"),
}


def _refuse_unused(config: TrainConfig, key: str) -> None:
    for prefix in _UNUSED.get(config.task, ()):
        if key == prefix or key.startswith(prefix + "."):
            reason = (
                "the model shape comes from init.parent"
                if prefix == "model"
                else "the tokenizer comes from init.parent"
                if prefix == "data.vocab_size"
                else "it does not read it"
            )
            raise RecipeError(f"{key}: not used by the {config.task!r} task ({reason})")


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
    items = dict(overrides or {})
    if "task" in items:  # the task decides which keys apply
        config = _override(config, ["task"], items.pop("task"), "task")
    for key, raw in items.items():
        config = _override(config, key.split("."), raw, key)
        _refuse_unused(config, key)
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


def corpus_files(corpus: str, field_name: str = "data.corpus") -> list[Path]:
    """The text files of a corpus (a file, ``.txt``/``.jsonl``/``.jsonl.gz``, or a directory of
    ``*.txt``); raises :class:`RecipeError` naming ``field_name`` when there is nothing to read."""
    path = resolve_data_path(corpus)
    if path.is_dir():
        files = sorted(p for p in path.glob("*.txt") if p.is_file())
    elif path.is_file():
        files = [path]
    else:
        raise RecipeError(f"{field_name}: {corpus!r} does not exist")
    if not files or all(p.stat().st_size == 0 for p in files):
        raise RecipeError(f"{field_name}: {corpus!r} is empty")
    return files


def pair_files(path: str, field_name: str = "pairs.path") -> list[Path]:
    """The ``.jsonl``/``.jsonl.gz`` files of a pair set; :class:`RecipeError` names ``field_name``."""
    root = resolve_data_path(path)
    if root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.is_file() and p.name.endswith((".jsonl", ".jsonl.gz")))
    elif root.is_file():
        files = [root]
    else:
        raise RecipeError(f"{field_name}: {path!r} does not exist")
    if not files or all(p.stat().st_size == 0 for p in files):
        raise RecipeError(f"{field_name}: {path!r} holds no non-empty .jsonl or .jsonl.gz file")
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
    if d.prefetch_batches < 0:
        raise RecipeError(f"data.prefetch_batches: must be >= 0, got {d.prefetch_batches}")
    if config.metrics.peak_flops < 0 or config.metrics.cpu_peak_flops_per_thread <= 0:
        raise RecipeError("metrics.peak_flops / metrics.cpu_peak_flops_per_thread: must be positive")
    _validate_task(config)


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
