"""The ``rerank`` task: a cross-encoder for the reranker, from a bundled encoder.

1. Read each dataset of ``rerank.datasets`` (BEIR: ``corpus.jsonl``, ``queries.jsonl``,
   ``qrels/train.tsv``); only the **train** qrels are read, so the test splits the retrieval
   evaluation reports on stay unseen.
2. Split each dataset's judged train queries by the run's seed: the last ``data.val_fraction``
   are held out, whole (no held-out query is trained on).
3. For every query, rank the corpus with BM25; its hard negatives are the best-ranked documents
   not judged relevant (top ``rerank.negative_depth``), its positives the relevant documents BM25
   retrieves in the top ``rerank.positive_depth`` (the ones a reranker of its candidates meets).
4. Groups of (query, one relevant passage, ``rerank.negatives`` hard negatives), each query's first
   positive before any query's second, at most ``rerank.groups_per_dataset`` per dataset. Every
   epoch after the first draws each group's negatives again from its query's pool
   (``rerank.resample_negatives``): with the same negatives every epoch, the held-out loss rose
   from the second epoch on while the training loss fell to a fifth of chance.
5. Pairs are encoded as ``[CLS] query [SEP] passage [SEP]``, the passage cut to fit
   ``data.seq_len`` word pieces: the held-out groups once, training groups as the loop's sampler
   draws them (in the prefetch thread).
6. Loss: each group's scores go through a softmax whose target is the relevant passage (listwise
   cross-entropy, as localized contrastive estimation); figures: how often the relevant passage
   ranks first of its group, and its reciprocal rank. Held-out: the same on the held-out groups,
   with the 95 % Wilson interval of the first-rank accuracy.
7. Export: ``BertForSequenceClassification`` (one label) and its tokenizer, the layout the
   reranker's ``CrossEncoderScorer`` (and sentence-transformers' ``CrossEncoder``) loads.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import random
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, PreTrainedModel

from forge_kit.paths import resolve_data_path
from forge_training.backbones import BACKBONE_NAMES, backbone_dir
from forge_training.collectives import all_reduce
from forge_training.data import StepSampler
from forge_training.mfu import train_flops_per_token
from forge_training.objectives import (
    Micro,
    Objective,
    encoder_classifier,
    encoder_head_prefixes,
    rank_batches,
    save_encoder,
    spread,
    wilson_interval,
)
from forge_training.recipes import RerankConfig, TrainConfig

_WORD = re.compile(r"\w+")


def _tokens(text: str) -> list[str]:
    return _WORD.findall(text.lower())


@dataclass(frozen=True)
class Dataset:
    """One BEIR dataset's corpus, queries and train judgements (``query id -> {doc id: grade}``)."""

    name: str
    doc_ids: list[str]
    texts: list[str]
    queries: dict[str, str]
    positives: dict[str, dict[str, int]]

    @cached_property
    def bm25(self) -> Bm25:
        """The corpus's BM25 index, built once for the training and the held-out groups."""
        return Bm25(self.texts)


def read_dataset(root: Path, name: str) -> Dataset:
    """Step 1 for one dataset."""
    folder = root / name
    if not (folder / "qrels" / "train.tsv").is_file():
        raise FileNotFoundError(f"{folder}: no qrels/train.tsv (a BEIR folder with a train split is needed)")
    doc_ids, texts = [], []
    with open(folder / "corpus.jsonl", encoding="utf-8") as f:
        for row in map(json.loads, f):
            doc_ids.append(str(row["_id"]))
            texts.append(f"{row.get('title', '')}\n{row['text']}".strip())
    with open(folder / "queries.jsonl", encoding="utf-8") as f:
        queries = {str(row["_id"]): row["text"] for row in map(json.loads, f)}
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
    passages: tuple[str, ...]
    """The relevant passage first, then the hard negatives drawn when the group was built."""
    pool: tuple[str, ...] = ()
    """Every hard-negative candidate of the query, which later epochs draw from again."""

    def redraw(self, k: int, rng: random.Random) -> tuple[str, ...]:
        """The relevant passage and ``k`` negatives drawn afresh from the pool."""
        return (self.passages[0], *rng.sample(self.pool, k))


def split_queries(data: Dataset, seed: int, val_fraction: float) -> tuple[list[str], list[str]]:
    """Step 2: the judged queries shuffled by ``seed``; (train, held out)."""
    qids = sorted(data.positives)
    random.Random(f"{seed}/{data.name}").shuffle(qids)
    held = round(len(qids) * val_fraction)
    return qids[: len(qids) - held], qids[len(qids) - held :]


def build_groups(
    data: Dataset, qids: Sequence[str], config: RerankConfig, rng: random.Random, limit: int
) -> list[Group]:
    """Steps 3-4 for the queries ``qids`` of one dataset, at most ``limit`` groups."""
    index = {d: i for i, d in enumerate(data.doc_ids)}
    depth = max(config.negative_depth, config.positive_depth)
    mined: dict[str, tuple[dict[int, int], list[int]]] = {}
    for qid in qids:
        ranked = data.bm25.top(data.queries[qid], depth)
        pool = [i for i in ranked[: config.negative_depth] if data.doc_ids[i] not in data.positives[qid]]
        mined[qid] = ({i: r for r, i in enumerate(ranked)}, pool)
    pairs = [
        (qid, did)
        for qid in qids
        for did in data.positives[qid]
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
    groups: list[Group] = []
    for _, qid, did in ordered[:limit]:
        candidates = tuple(data.texts[i] for i in mined[qid][1])
        negatives = rng.sample(candidates, config.negatives)
        groups.append(Group(data.queries[qid], (data.texts[index[did]], *negatives), candidates))
    return groups


def rerank_data_hash(config: TrainConfig) -> str:
    """Identifies the groups: the rerank section, the split and each dataset file's size."""
    files = {
        f"{name}/{part}": (resolve_data_path(config.rerank.root) / name / part).stat().st_size
        for name in config.rerank.names()
        for part in ("corpus.jsonl", "queries.jsonl", "qrels/train.tsv")
    }
    blob = json.dumps(
        {
            "rerank": config.rerank.__dict__,
            "seed": config.seed,
            "val_fraction": config.data.val_fraction,
            "seq_len": config.data.seq_len,
            "files": files,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


Encoded = tuple[list[int], list[int]]
"""One (query, passage) pair: word-piece ids and token type ids."""


class EpochTagged:
    """A :class:`StepSampler` whose items carry the epoch they were drawn in (the negatives of a
    group depend on it); position and resume are the inner sampler's."""

    def __init__(self, inner: StepSampler) -> None:
        self.inner = inner

    def next_step(self, rank: int, world_size: int) -> list[tuple[int, int]]:
        picked = self.inner.next_step(rank, world_size)
        return [(i, self.inner.state.epoch) for i in picked]

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


class CrossEncoderRanking(Objective):
    """Steps 1-7 of the module docstring. Loss units are groups."""

    task = "rerank"
    figure_names = ("rank_accuracy", "reciprocal_rank")

    def __init__(self, config: TrainConfig, rank: int, world_size: int) -> None:
        super().__init__(config, rank, world_size)
        r = config.rerank
        self.source = backbone_dir(config.init.backbone)
        self.tokenizer_json = (self.source / "tokenizer.json").read_text(encoding="utf-8")
        tokenizer = AutoTokenizer.from_pretrained(self.source)
        self.pad_id = int(tokenizer.pad_token_id)
        self.group_size = 1 + r.negatives
        rng = random.Random(config.seed)
        train: list[Group] = []
        val: list[Group] = []
        self.counts: dict[str, dict[str, int]] = {}
        for name in r.names():
            data = read_dataset(resolve_data_path(r.root), name)
            train_q, val_q = split_queries(data, config.seed, config.data.val_fraction)
            mine = build_groups(data, train_q, r, rng, r.groups_per_dataset)
            held = build_groups(data, val_q, r, rng, len(val_q))
            self.counts[name] = {"train_groups": len(mine), "heldout_groups": len(held)}
            train += mine
            val += held
        rng.shuffle(train)
        if len(train) < config.global_batch_size:
            raise ValueError(
                f"rerank.datasets: {len(train)} training groups, fewer than one global batch "
                f"({config.global_batch_size}); check the datasets and rerank.groups_per_dataset"
            )
        if not val:
            raise ValueError("data.val_fraction: no held-out group (too few judged queries)")
        self.train_groups = train
        self.val_rows = self._encode(tokenizer, [g.passages for g in val], [g.query for g in val])
        self._tokenizer = tokenizer  # training batches are encoded as drawn, in the prefetch thread
        self.data_hash = rerank_data_hash(config)
        self.sampler = EpochTagged(StepSampler(len(train), config.global_batch_size, config.seed))
        self.model = encoder_classifier(self.source, config.data.seq_len, self.pad_id, config.init)

    def _encode(
        self, tokenizer: Any, passages: Sequence[Sequence[str]], queries: Sequence[str]
    ) -> list[list[Encoded]]:
        """Step 5: every (query, passage) pair of each group, cut to ``data.seq_len``."""
        encoded = tokenizer(
            [q for q, group in zip(queries, passages, strict=True) for _ in group],
            [p for group in passages for p in group],
            truncation="only_second",
            max_length=self.config.data.seq_len,
        )
        pairs = list(zip(encoded["input_ids"], encoded["token_type_ids"], strict=True))
        n = self.group_size
        return [pairs[i * n : (i + 1) * n] for i in range(len(passages))]

    def passages(self, index: int, epoch: int) -> tuple[str, ...]:
        """Training group ``index``'s passages in ``epoch``: the negatives drawn at build time in
        the first epoch, drawn again from the group's pool in every later one (with
        ``rerank.resample_negatives``), from a generator seeded by (seed, epoch, index), so a
        resumed run sees the same groups."""
        group = self.train_groups[index]
        if epoch == 0 or not self.config.rerank.resample_negatives:
            return group.passages
        rng = random.Random(f"{self.config.seed}/{epoch}/{index}")
        return group.redraw(self.config.rerank.negatives, rng)

    def head_prefixes(self) -> tuple[str, ...]:
        return encoder_head_prefixes(self.model)

    def collate(self, items: Sequence[Any], rows: Sequence[list[Encoded]] | None = None) -> Micro:
        """Training items are (group index, epoch) from the sampler; held-out items index ``rows``."""
        if rows is None:
            groups = [self.passages(i, epoch) for i, epoch in items]
            queries = [self.train_groups[i].query for i, _ in items]
            pairs = [pair for group in self._encode(self._tokenizer, groups, queries) for pair in group]
        else:
            pairs = [pair for i in items for pair in rows[i]]
        width = max(len(ids) for ids, _ in pairs)
        ids = torch.full((len(pairs), width), self.pad_id, dtype=torch.long)
        types = torch.zeros((len(pairs), width), dtype=torch.long)
        mask = torch.zeros((len(pairs), width), dtype=torch.long)
        for row, (tokens, type_ids) in enumerate(pairs):
            ids[row, : len(tokens)] = torch.tensor(tokens)
            types[row, : len(tokens)] = torch.tensor(type_ids)
            mask[row, : len(tokens)] = 1
        return {"input_ids": ids, "token_type_ids": types, "attention_mask": mask}

    def units(self, micro: Micro) -> float:
        return float(micro["input_ids"].size(0) // self.group_size)

    def flops(self, micro: Micro) -> float:
        per_token = train_flops_per_token(self.model.config, 1, micro["input_ids"].size(1))
        return float(micro["attention_mask"].sum()) * per_token

    def scores(self, module: torch.nn.Module, micro: Micro) -> torch.Tensor:
        """(groups, group size) scores; the relevant passage is column 0."""
        logits = module(
            input_ids=micro["input_ids"],
            token_type_ids=micro["token_type_ids"],
            attention_mask=micro["attention_mask"],
        ).logits
        return logits.float().reshape(-1, self.group_size)

    @staticmethod
    def _figures(scores: torch.Tensor) -> list[float]:
        """Groups whose relevant passage ranks first (ties count against it), and the sum of its
        reciprocal ranks."""
        ahead = (scores[:, 1:] >= scores[:, :1]).sum(-1)
        return [float((ahead == 0).sum()), float((1.0 / (ahead + 1).float()).sum())]

    def loss(self, module: torch.nn.Module, micro: Micro) -> tuple[torch.Tensor, list[float]]:
        scores = self.scores(module, micro)
        target = torch.zeros(scores.size(0), dtype=torch.long)
        return F.cross_entropy(scores, target, reduction="sum"), self._figures(scores.detach())

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        every = spread(len(self.val_rows), self.config.eval_batches * self.config.micro_batch_size)
        batches = rank_batches(every, self.rank, self.world_size, self.config.micro_batch_size)
        self.model.eval()
        sums = [0.0, 0.0, 0.0, 0.0]  # loss, first, reciprocal rank, groups
        for items, counts in batches:
            scores = self.scores(self.model, self.collate(items, self.val_rows))
            if not counts:
                continue
            target = torch.zeros(scores.size(0), dtype=torch.long)
            first, reciprocal = self._figures(scores)
            sums = [
                sums[0] + float(F.cross_entropy(scores, target, reduction="sum")),
                sums[1] + first,
                sums[2] + reciprocal,
                sums[3] + scores.size(0),
            ]
        self.model.train()
        total, first, reciprocal, n = all_reduce(sums, self.world_size)
        low, high = wilson_interval(first, n)
        return {
            "val_loss": total / n,
            "val_rank_accuracy": first / n,
            "val_rank_accuracy_low": low,
            "val_rank_accuracy_high": high,
            "val_mrr": reciprocal / n,
            "chance_loss": math.log(self.group_size),
            "eval_groups": n,
        }

    def start(self) -> dict[str, float]:
        return self.evaluate()

    def model_meta(self) -> dict[str, Any]:
        return {
            **super().model_meta(),
            "backbone": BACKBONE_NAMES.get(self.config.init.backbone, ""),
            "groups": self.counts,
        }

    def export(self, out_dir: Path, model: PreTrainedModel | None = None) -> Path:
        return save_encoder(model or self.model, self.source, out_dir, self.config.data.seq_len)
