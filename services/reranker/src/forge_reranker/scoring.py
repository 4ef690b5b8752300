"""Relevance scorers: the ``Scorer`` seam, the lexical scorer and the cross-encoder behind it.

The lexical scorer is BM25 with the call's passages as the corpus (so IDF rewards the words that
tell these candidates apart) plus a bonus for passages that contain the query as a phrase. The
cross-encoder reads query and passage together in one transformer pass: far better relevance, and
far more CPU, hence INT8, batching and the score cache.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

_WORD = re.compile(r"\w+")


def tokenize(text: str) -> list[str]:
    """Lowercase word tokens (Unicode letters, digits and underscore)."""
    return _WORD.findall(text.lower())


class Scorer(Protocol):
    """Scores passages against a query; higher is more relevant.

    Called by ``RerankerService`` once per Rerank call (from a worker thread: scoring may be
    CPU-heavy) with the passages whose scores are not cached. ``name`` is what callers ask for in
    ``RerankRequest.model`` and what responses report; ``version`` changes whenever the scores for
    the same inputs would (weights, parameters) and is part of every cache key. A scorer that is
    ``batch_dependent`` scores a passage relative to the others of the call: its scores are cached
    per set of passages and it is always given the whole set.
    """

    name: str
    version: str
    batch_dependent: bool

    def score(self, query: str, passages: Sequence[str]) -> list[float]:
        """One score per passage, in order."""


class LexicalScorer:
    """BM25 over the given passages as the corpus, plus an exact-phrase bonus.

    For a query of two words or more, a passage containing the whole query as a contiguous phrase
    gains ``phrase_bonus``; one containing only some of the query's word pairs gains
    ``phrase_bonus / 2`` times the share it contains.
    """

    name = "bm25-phrase"
    batch_dependent = True

    def __init__(self, k1: float = 1.2, b: float = 0.75, phrase_bonus: float = 1.0) -> None:
        if k1 < 0 or not 0 <= b <= 1 or phrase_bonus < 0:
            raise ValueError(f"need k1 >= 0, 0 <= b <= 1, phrase_bonus >= 0; got {k1=} {b=} {phrase_bonus=}")
        self.k1, self.b, self.phrase_bonus = k1, b, phrase_bonus
        params = f"{self.name}:k1={k1}:b={b}:phrase={phrase_bonus}"
        self.version = hashlib.sha256(params.encode()).hexdigest()[:16]

    def score(self, query: str, passages: Sequence[str]) -> list[float]:
        query_tokens = tokenize(query)
        docs = [tokenize(p) for p in passages]
        if not docs or not query_tokens:
            return [0.0] * len(docs)
        n = len(docs)
        avg_len = max(1.0, sum(len(d) for d in docs) / n)
        terms = set(query_tokens)
        df = Counter(t for d in docs for t in terms.intersection(d))
        idf = {t: math.log(1.0 + (n - df[t] + 0.5) / (df[t] + 0.5)) for t in terms}
        query_pairs = set(itertools.pairwise(query_tokens))
        scores = []
        for doc in docs:
            tf = Counter(doc)
            norm = self.k1 * (1.0 - self.b + self.b * len(doc) / avg_len)
            bm25 = sum(idf[t] * tf[t] * (self.k1 + 1.0) / (tf[t] + norm) for t in terms if tf[t])
            scores.append(bm25 + self._phrase(query_tokens, query_pairs, doc))
        return scores

    def _phrase(self, query: list[str], query_pairs: set[tuple[str, str]], doc: list[str]) -> float:
        if len(query) < 2 or not self.phrase_bonus:
            return 0.0
        width = len(query)
        if any(doc[i : i + width] == query for i in range(len(doc) - width + 1)):
            return self.phrase_bonus
        shared = query_pairs.intersection(itertools.pairwise(doc))
        return self.phrase_bonus * 0.5 * len(shared) / len(query_pairs)


class CrossEncoderScorer:
    """A Hugging Face cross-encoder (any ``AutoModelForSequenceClassification`` directory with one
    output), scoring (query, passage) pairs jointly on CPU.

    Pairs are tokenized together and truncated to ``max_tokens`` word pieces (the passage is cut,
    never the query), and scored ``batch_size`` at a time; the texts of a call are sorted by length
    first so a batch pads to similar lengths. With ``int8`` the Linear layers are dynamically
    quantised (weights INT8, activations quantised per batch): about twice as fast on CPU; the
    benchmark prints the accuracy it costs. ``version`` hashes the weights and these settings, so
    the score cache never serves a score of another model or configuration.
    """

    batch_dependent = False

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_tokens: int = 256,
        batch_size: int = 16,
        int8: bool = False,
        num_threads: int = 0,
    ) -> None:
        if max_tokens < 16 or batch_size < 1 or num_threads < 0:
            raise ValueError(
                f"need max_tokens >= 16, batch_size >= 1, num_threads >= 0; got {max_tokens=} {batch_size=}"
            )
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = Path(model_dir)
        weights = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
        if not (path / "config.json").is_file() or not weights:
            raise FileNotFoundError(f"no Hugging Face model (config.json and weights) in {path}")
        if num_threads:
            torch.set_num_threads(num_threads)
        self._torch = torch
        self._tokenizer = AutoTokenizer.from_pretrained(str(path))
        model = AutoModelForSequenceClassification.from_pretrained(str(path))
        if model.config.num_labels != 1:
            raise ValueError(
                f"{path}: a cross-encoder has one output (num_labels=1), got {model.config.num_labels}"
            )
        model.eval()
        if int8:
            model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
        self._model = model
        self._max_tokens, self._batch_size = max_tokens, batch_size
        self.name = path.name
        digest = hashlib.sha256(f"{max_tokens}:{int8}".encode())
        for file in weights:
            with open(file, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
        self.version = digest.hexdigest()[:16]

    def score(self, query: str, passages: Sequence[str]) -> list[float]:
        order = sorted(range(len(passages)), key=lambda i: len(passages[i]))
        scores = [0.0] * len(passages)
        with self._torch.inference_mode():
            for first in range(0, len(order), self._batch_size):
                batch = order[first : first + self._batch_size]
                encoded = self._tokenizer(
                    [query] * len(batch),
                    [passages[i] for i in batch],
                    truncation="only_second",
                    max_length=self._max_tokens,
                    padding=True,
                    return_tensors="pt",
                )
                logits = self._model(**encoded).logits.reshape(-1)
                for i, value in zip(batch, logits.tolist(), strict=True):
                    scores[i] = float(value)
        return scores
