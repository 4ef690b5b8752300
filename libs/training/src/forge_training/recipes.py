"""The recipe catalogue: each recipe a Python function returning a frozen
:class:`~forge_training.schema.TrainConfig` (the schema), named in :data:`RECIPES`.

A recipe is the whole description of a run; overrides are ``dotted.key=value`` pairs applied to
it. :func:`build` refuses unknown recipes and keys (and keys of sections the recipe's task does not
read); :func:`forge_training.validation.validate` refuses impossible configurations, before any
worker starts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from forge_training import schema
from forge_training.schema import (
    DEFAULT_CORPUS,
    HH_RLHF,
    SCIFACT_CORPUS,
    VLM_WORLD_TEXT,
    CheckpointConfig,
    DataConfig,
    InitConfig,
    MixtureConfig,
    ModelConfig,
    OptimConfig,
    PairsConfig,
    RecipeError,
    TrainConfig,
    VlmConfig,
)


def shakespeare_tiny() -> TrainConfig:
    """The CPU baseline: nanoGPT's ``--device=cpu`` shape (4 layers, 4 heads, 128 wide, batch
    12 x 64) on tinyshakespeare with a 512-token byte-level BPE."""
    return TrainConfig(name="shakespeare_tiny")


def smoke() -> TrainConfig:
    """A few seconds of training, for tests and for checking a node end to end. One head of 64:
    the smallest head size vLLM's CPU attention serves (it refuses 16), so the main job's model
    is served by vLLM."""
    return TrainConfig(
        name="smoke",
        model=ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=1, num_kv_heads=1),
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
    held out better than 1x (``load/training/RESULTS.md``). Pairs are length-balanced
    (``pairs.length_balance=reweight``: the pairs whose chosen reply is the shorter weigh as much
    in all as those whose chosen reply is the longer), the debiasing that kept overall held-out
    accuracy within 0.02 of the unbalanced recipe's while judging fewer pairs by length alone
    (``load/feedback/RESULTS.md`` compares it with ODIN's length head and a post-hoc correction)."""
    return TrainConfig(
        name="reward_hh_minilm",
        task="reward",
        init=InitConfig(backbone="minilm"),
        data=DataConfig(seq_len=256, val_fraction=0.3),
        pairs=PairsConfig(
            path=f"{HH_RLHF}/helpful-base", exclude_shared_openings=True, length_balance="reweight"
        ),
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


def vlm_world_lm() -> TrainConfig:
    """The VLM curriculum's language model: a tiny Llama pre-trained on the synthetic visual
    world's text (captions, descriptions, train-template questions with answers), so the LM
    speaks the world's language before it sees an image, as a real VLM's LM has read the web.
    One head of 64: the size vLLM's CPU and GPU attention serve, so every stage's LLaVA export
    over it loads in vLLM."""
    return TrainConfig(
        name="vlm_world_lm",
        model=ModelConfig(hidden_size=64, intermediate_size=172, num_layers=3, num_heads=1, num_kv_heads=1),
        data=DataConfig(corpus=VLM_WORLD_TEXT, vocab_size=512, seq_len=64),
        optim=OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=30),
        checkpoint=CheckpointConfig(interval_steps=200, keep_last=2),
        global_batch_size=16,
        micro_batch_size=16,
        max_steps=600,
        eval_interval=300,
        eval_batches=8,
        log_interval=20,
    )


def _vlm(
    name: str, stage: str, lr: float, max_steps: int, seq_len: int, batch: int = 16, **vlm: object
) -> TrainConfig:
    return TrainConfig(
        name=name,
        task="vlm",
        vlm=VlmConfig(stage=stage, **vlm),  # type: ignore[arg-type]
        data=DataConfig(seq_len=seq_len, prefetch_batches=2),
        optim=OptimConfig(lr=lr, min_lr=lr / 10, warmup_steps=20, weight_decay=0.0),
        checkpoint=CheckpointConfig(interval_steps=200, keep_last=2),
        global_batch_size=batch,
        micro_batch_size=16,
        max_steps=max_steps,
        eval_interval=max_steps,
        eval_batches=4,
        log_interval=20,
    )


def vlm_align() -> TrainConfig:
    """VLM stage 1 (feature alignment): captions of the synthetic world; the MLP projector and
    the parent LM train (``vlm.align_lm``), the (fresh) CLIP vision tower stays frozen. LLaVA
    trains only the projector here, but this 3-layer LM, frozen, never learns to read the
    projected patches (its caption words for colour, shape and size stay at chance however long
    the stage); trained with them for 600 steps it names all three. Parent: a causal LM
    (``vlm_world_lm``'s export)."""
    return _vlm("vlm_align", "align", lr=2e-3, max_steps=600, seq_len=64, batch=32, align_lm=True)


def vlm_interleave() -> TrainConfig:
    """VLM stage 2: interleaved documents (text, image, text, ...) with 20 % text-only replay of
    the world's text; the projector and the LM train (the vision tower stays frozen). Parent:
    stage 1's VLM."""
    return _vlm("vlm_interleave", "interleave", lr=1e-3, max_steps=400, seq_len=240)


def vlm_instruct() -> TrainConfig:
    """VLM stage 3: instruction tuning on VQA chats (train question templates) and caption
    chats; loss on the reply; the projector and the LM train. Parent: stage 2's VLM."""
    return _vlm("vlm_instruct", "instruct", lr=1e-3, max_steps=600, seq_len=80, batch=32)


def vlm_joint() -> TrainConfig:
    """One-stage joint training from scratch, the curriculum's baseline: captions, documents and
    chats (1:1:2) with 20 % text replay, every weight fresh (the parent LM gives only the
    tokenizer and the shapes); the fresh vision tower stays frozen, as in the curriculum."""
    return _vlm("vlm_joint", "joint", lr=2e-3, max_steps=1700, seq_len=240, from_scratch=True)


RECIPES: dict[str, Callable[[], TrainConfig]] = {
    "shakespeare_tiny": shakespeare_tiny,
    "smoke": smoke,
    "cpt_scifact": cpt_scifact,
    "sft_hh": sft_hh,
    "reward_hh": reward_hh,
    "reward_hh_minilm": reward_hh_minilm,
    "dpo_hh": dpo_hh,
    "rerank_beir_minilm": rerank_beir_minilm,
    "vlm_world_lm": vlm_world_lm,
    "vlm_align": vlm_align,
    "vlm_interleave": vlm_interleave,
    "vlm_instruct": vlm_instruct,
    "vlm_joint": vlm_joint,
}


def build(recipe: str, overrides: Mapping[str, Any] | None = None) -> TrainConfig:
    """The recipe named ``recipe`` with ``overrides`` (``{"optim.lr": "3e-4"}``) applied."""
    if recipe not in RECIPES:
        raise RecipeError(f"recipe: unknown recipe {recipe!r} (known: {', '.join(sorted(RECIPES))})")
    config = RECIPES[recipe]()
    items = dict(overrides or {})
    if "task" in items:  # the task decides which keys apply
        config = schema.override(config, ["task"], items.pop("task"), "task")
    for key, raw in items.items():
        config = schema.override(config, key.split("."), raw, key)
        schema.refuse_unused(config, key)
    return config
