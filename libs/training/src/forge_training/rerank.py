"""The ``rerank`` task: a cross-encoder for the reranker, from a bundled encoder. Its data (steps
1-4) is here; the objective (steps 5-7) is :mod:`forge_training.objectives.rerank`.

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

from forge_kit.paths import resolve_data_path
from forge_training.data import StepSampler
from forge_training.schema import RerankConfig, TrainConfig

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
