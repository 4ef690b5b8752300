"""The ONNX Runtime embedder against sentence-transformers on the same bundled MiniLM."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from forge_retriever.config import RetrieverSettings
from forge_retriever.embed import OnnxEmbedder, SentenceTransformerEmbedder, embedder_for, make_embedder

TEXTS = [
    "TNFAIP3 is a tumor suppressor in glioblastoma.",
    "Zebras have black and white stripes that confuse biting flies and predators.",
    "The zebra migration crosses the Mara river every July, led by wildebeest herds. " * 8,
    "x",
]


def _cos(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the exports are cached: ``<data_dir>/models`` as the service lays it out."""
    return tmp_path_factory.mktemp("retriever-data") / "models"


@pytest.mark.parametrize(("int8", "floor"), [(False, 0.9999), (True, 0.97)])
def test_vectors_match_sentence_transformers(
    minilm: SentenceTransformerEmbedder, models: Path, int8: bool, floor: float
) -> None:
    onnx = OnnxEmbedder(cache_dir=models, int8=int8, batch_size=2)
    reference = minilm.embed_documents(TEXTS)
    vectors = onnx.embed_documents(TEXTS)
    assert onnx.dimension == minilm.dimension == len(vectors[0])
    for got, want in zip(vectors, reference, strict=True):
        assert math.isclose(sum(x * x for x in got), 1.0, rel_tol=1e-5)
        assert _cos(got, want) >= floor
    # Batched or alone: the same vector up to float rounding in fp32; with INT8, activations are
    # quantised per batch (its range sets the scale), so the batch moves a vector a little.
    alone = onnx.embed_query(TEXTS[0])
    assert _cos(alone, vectors[0]) >= (1 - 1e-6 if not int8 else 0.99)
    assert onnx.embed_query(TEXTS[0]) == alone and onnx.cache_hits == 1
    # Both backends read the same tokens (usage of the gateway's /v1/embeddings).
    assert onnx.count_tokens([*TEXTS, "word " * 1000]) == minilm.count_tokens([*TEXTS, "word " * 1000])
    assert onnx.count_tokens(["word " * 1000]) == [256]


def test_the_export_is_cached_and_versions_tell_backends_apart(
    minilm: SentenceTransformerEmbedder, models: Path
) -> None:
    first = OnnxEmbedder(cache_dir=models, int8=True)
    exported = sorted(models.glob("*.onnx"))
    again = OnnxEmbedder(cache_dir=models, int8=True)
    assert sorted(models.glob("*.onnx")) == exported  # loaded, not exported again
    assert again.version == first.version
    fp32 = OnnxEmbedder(cache_dir=models, int8=False)
    shorter = OnnxEmbedder(cache_dir=models, int8=True, max_seq_length=128)
    assert len({first.version, fp32.version, shorter.version, minilm.version}) == 4


def test_backend_comes_from_settings_and_unknown_ones_are_refused(models: Path, tmp_path: Path) -> None:
    settings = RetrieverSettings(data_dir=str(models.parent), kafka_enabled=False, embedding_backend="onnx")
    embedder = embedder_for(settings, query_cache_size=0)
    assert (
        isinstance(embedder, OnnxEmbedder)
        and embedder.version == OnnxEmbedder(cache_dir=models, int8=False).version
    )
    with pytest.raises(ValueError, match="unknown embedding backend 'tpu'"):
        make_embedder(
            "tpu", None, cache_dir=tmp_path, batch_size=1, max_seq_length=8, query_cache_size=0, num_threads=0
        )
    with pytest.raises(ValueError, match="embedding_backend"):
        RetrieverSettings(data_dir=str(tmp_path), kafka_enabled=False, embedding_backend="tpu")  # type: ignore[arg-type]
