"""The recipe schema: a run's whole description as frozen dataclasses (:class:`TrainConfig` and
its sections), how ``dotted.key=value`` overrides apply to it (:func:`override`: unknown keys and
keys of sections the task does not read are refused), and :func:`from_dict` for a config read back
from a checkpoint manifest. The recipes themselves are :mod:`forge_training.recipes` (the
catalogue); :mod:`forge_training.validation` refuses configurations that cannot run.

Tasks (``TrainConfig.task``): ``pretrain`` (from scratch, own tokenizer), ``cpt`` (continual
pre-training on a domain corpus mixed with general data), ``sft`` (prompt/response pairs, loss on
the response), ``reward`` (scalar head, Bradley-Terry on chosen/rejected pairs), ``dpo`` (against
the frozen parent) and ``rerank`` (a cross-encoder). Every task but ``pretrain`` starts from
``init.parent``, except a ``reward`` or ``rerank`` run with ``init.backbone=minilm``: a bundled BERT
encoder (see :mod:`backbones`) under a new scalar head, with its own WordPiece tokenizer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Data paths: absolute, or relative to the data folder (FORGE_DATA_DIR, filled by `forge data fetch`).
#: The pre-training corpus: 1.1 MB of Shakespeare.
DEFAULT_CORPUS = "corpora/tinyshakespeare/input.txt"
#: A domain corpus for continual pre-training: 5,183 scientific abstracts (BEIR SciFact).
SCIFACT_CORPUS = "beir/scifact/corpus.jsonl"
#: Anthropic HH-RLHF chosen/rejected pairs (helpful-base and harmless-base test splits).
HH_RLHF = "preferences/hh-rlhf"
#: The synthetic visual world's plain text (``python -m forge_training.vlm.dataset
#: $FORGE_DATA_DIR/vlm/world-0`` writes it; the VLM stages generate the same world in their cache).
VLM_WORLD_TEXT = "vlm/world-0/text.txt"
#: BEIR datasets (corpus.jsonl, queries.jsonl, qrels/{train,dev,test}.tsv per folder).
BEIR = "beir"

TASKS = ("pretrain", "cpt", "sft", "reward", "dpo", "rerank", "vlm")
#: Tasks that may start from a bundled encoder (``init.backbone``) instead of a parent.
ENCODER_TASKS = ("reward", "rerank")
INTERVAL_POLICIES = ("steps", "young", "daly")
PARALLELISMS = ("ddp", "fsdp")
#: ``precision`` values (see :mod:`forge_training.precision`).
PRECISIONS = ("fp32", "bf16", "fp16")
#: ``device`` values (see :mod:`forge_training.device`).
DEVICES = ("auto", "cpu", "cuda")
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
    extra_val_fraction: float = 0.0
    """Hold out this share of the ``extra_train`` pairs (shuffled by ``seed``, the last ones) from
    training, so that another collection round is both trained on and evaluated on pairs never
    seen: the encoder reward model writes them to ``<cache dir>/held_out_extra_pairs.jsonl``.
    Under ``exclude_shared_openings`` no training pair opens like one of them either."""
    exclude_shared_openings: bool = False
    """Drop from training every pair whose opening user turn is also a held-out pair's (HH-RLHF
    has distinct conversations that start alike: 147 of helpful-base's 2,339 pairs share their
    opening with another), so no held-out conversation is even partly trained on."""
    length_balance: str = "none"
    """``reward`` only: how training pairs are balanced between those whose chosen reply is the
    longer one and those where it is the shorter one (lengths in words, :mod:`forge_experiments.rmlength`):
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
    Disentangled Reward Mitigates Hacking in RLHF"), see :mod:`forge_training.objectives.lengthdebias`."""

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


#: ``vlm.stage`` values: the curriculum's three stages and one-stage joint training.
VLM_STAGES = ("align", "interleave", "instruct", "joint")


@dataclass(frozen=True)
class VlmConfig:
    """A vision-language run (``vlm``, see :mod:`forge_training.objectives.vlm`)."""

    stage: str = "align"
    """``align`` (captions; only the projector trains; parent: a causal LM), ``interleave``
    (documents plus ``text_replay`` of text-only windows; all trains; parent: a VLM), ``instruct``
    (VQA and caption chats; all trains; parent: a VLM) or ``joint`` (all sources at once; parent:
    a causal LM, whose tokenizer and shape are kept; with ``from_scratch`` its weights are not)."""
    world: str = "synthetic"
    """``synthetic`` (the generated world, written to the cache dir) or a folder of the same layout
    (``captions/``, ``documents/``, ``chats/`` shards, ``text.txt``, ``eval/val/``)."""
    world_seed: int = 0
    image_size: int = 32
    patch_size: int = 8
    """8-pixel patches: a 16-token image, each object of the world's 2 x 2 grid over 4 patches,
    so a patch sees an object's corner or edge, which tells the shapes apart (see
    ``load/vlm/README.md``; with one 16-pixel patch per cell no model read the shape)."""
    vision_hidden_size: int = 64
    vision_layers: int = 2
    vision_heads: int = 2
    text_replay: float = 0.2
    """``interleave``: share of text-only sequences in a batch (``joint``: of its mixture)."""
    caption_replay: float = 0.0
    """``interleave``: share of stage 1's caption samples in a batch (the documents get the rest
    after ``text_replay``), so that the stage keeps what the alignment learnt."""
    joint_weights: str = "captions:1,documents:1,chats:2"
    """``joint``: sampling weights of the image sources (text gets ``text_replay``)."""
    from_scratch: bool = False
    """``joint``: initialise every weight afresh (the parent gives only the tokenizer and shape)."""
    align_lm: bool = False
    """``align``: the language model trains too, at the stage's rate (off: only the projector,
    LLaVA's stage 1). A small LM that has only read text does not learn to read a frozen
    projector's soft tokens, so the curriculum's caption stage aligns both."""
    train_vision: bool = False
    """Whether the vision tower trains (``interleave``, ``instruct``, ``joint``; ``align`` never
    trains it). Off: the tower stays as the parent (or the fresh init) made it, as
    LLaVA keeps its CLIP encoder frozen in every stage; trained at the LM's learning rate, this
    small tower lost most of the colour and shape content of its patches."""
    eval_items: int = 64
    """Held-in validation chats (train templates, unseen scenes) scored by generation each eval."""
    max_new_tokens: int = 8


#: Learning-rate schedules after warmup (``optim.schedule``).
SCHEDULES = ("cosine", "wsd")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup, then ``schedule`` down to ``min_lr``."""

    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    schedule: str = "cosine"
    """``cosine`` (from the end of warmup to ``max_steps``) or ``wsd`` (warmup-stable-decay: the
    peak rate until the last ``decay_fraction`` of ``max_steps``, then a cosine down to ``min_lr``).
    Under ``wsd`` every trial of a sweep trains at its own constant rate up to the decay, so
    early-stopping rungs before it compare trials by what they learnt, not by where their decay
    stands."""
    decay_fraction: float = 0.2
    """``wsd``: the share of ``max_steps`` spent decaying (0: a constant rate to the end)."""
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
class RungCooldownConfig:
    """Evaluations after a cooldown branch at a sweep's rungs (:mod:`forge_training.cooldown`):
    at each step ``min_steps · eta^k`` below ``max_steps``, decay the rate linearly to zero over
    ``ceil(fraction · step)`` steps from the current state, log the evaluation as ``cooldown_*``,
    and go on from the state before the branch."""

    fraction: float = 0.0
    """Branch length as a share of the steps so far (0: no branches)."""
    min_steps: int = 0
    """The first rung's step."""
    eta: int = 3
    """Rung spacing (each rung ``eta`` times the previous one)."""


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
    vlm: VlmConfig = field(default_factory=VlmConfig)
    rung_cooldown: RungCooldownConfig = field(default_factory=RungCooldownConfig)
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
    device: str = "auto"
    """Where each rank trains: ``auto`` (``cuda:LOCAL_RANK`` when the job was given GPUs, else the
    CPU), ``cpu``, or ``cuda`` (refuse to start without a GPU). See :mod:`device`."""
    precision: str = "fp32"
    """``fp32``; ``bf16`` (autocast forward passes, fp32 master weights and reductions); or
    ``fp16`` (autocast with loss scaling; not with ``fsdp``). See :mod:`precision`."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in the backward pass (less memory, about a
    third more compute)."""
    compile: bool = False
    """``torch.compile`` each transformer block (torchtitan's regional compilation)."""

    def grad_accum_steps(self, world_size: int) -> int:
        return self.global_batch_size // (world_size * self.micro_batch_size)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def recipe_hash(self) -> str:
        """Identifies the configuration in checkpoint lineage."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


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
    "vlm": (*_NO_CORPUS, "pairs", "reward", "dpo", "rerank", "optim.head_lr_scale"),
}
for _task in [t for t in _UNUSED if t != "vlm"]:  # text tasks ignore the vision-language section
    _UNUSED[_task] = (*_UNUSED[_task], "vlm")


def refuse_unused(config: TrainConfig, key: str) -> None:
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


def override(obj: Any, parts: list[str], raw: Any, key: str) -> Any:
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
    return dataclasses.replace(obj, **{parts[0]: override(current, parts[1:], raw, key)})


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
        config = override(config, key.split("."), value, key)
    return config
