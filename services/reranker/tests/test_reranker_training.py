"""The cross-encoder training recipe on a tiny BEIR folder written here, from the real MiniLM."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
from pathlib import Path

import pytest

from forge_reranker.scoring import CrossEncoderScorer
from forge_reranker.training import (
    Bm25,
    TrainConfig,
    _param_groups,
    beir_train_recipe,
    build_groups,
    lr_factor,
    read_dataset,
    train,
)

DOCS = {
    "d1": ("Volcanoes", "volcanic eruptions emit sulphur dioxide and ash into the atmosphere"),
    "d2": ("Bread", "yeast makes bread dough rise by producing carbon dioxide"),
    "d3": ("Climate", "sulphur dioxide aerosols from eruptions cool the climate for a year"),
    "d4": ("Oceans", "carbon dioxide dissolves in oceans and lowers their ph"),
    "d5": ("Soil", "volcanic ash makes fertile soil for farming"),
}
QUERIES = {
    "q1": "do eruptions emit sulphur dioxide",
    "q2": "how does dough rise",
    "q3": "ocean acidity and carbon",
}
TRAIN = [("q1", "d1"), ("q2", "d2"), ("q3", "d4")]


def write_beir(root: Path, name: str) -> Path:
    folder = root / name
    (folder / "qrels").mkdir(parents=True)
    with open(folder / "corpus.jsonl", "w") as f:
        for doc_id, (title, text) in DOCS.items():
            f.write(json.dumps({"_id": doc_id, "title": title, "text": text}) + "\n")
    with open(folder / "queries.jsonl", "w") as f:
        for qid, text in QUERIES.items():
            f.write(json.dumps({"_id": qid, "text": text}) + "\n")
    (folder / "qrels" / "train.tsv").write_text(
        "query-id\tcorpus-id\tscore\n" + "".join(f"{q}\t{d}\t1\n" for q, d in TRAIN)
    )
    return folder


def tiny_recipe(groups: int = 3, **overrides: object) -> TrainConfig:
    """The recipe on the ``tiny`` folder of :func:`write_beir`: one hard negative from the top 5."""
    return beir_train_recipe(
        datasets=("tiny",), groups_per_dataset={"tiny": groups}, negatives=1, negative_depth=5, **overrides
    )


def test_bm25_ranks_by_shared_rare_terms() -> None:
    bm25 = Bm25([f"{t} {x}" for t, x in DOCS.values()])
    assert bm25.top("sulphur dioxide eruptions", 2) == [0, 2]
    assert bm25.top("nothing matches", 3) == []


def test_groups_put_the_positive_first_and_never_a_judged_document_among_negatives(tmp_path: Path) -> None:
    write_beir(tmp_path, "tiny")
    data = read_dataset(tmp_path, "tiny")
    config = tiny_recipe(10)
    groups = build_groups(data, config, random.Random(0))
    # "how does dough rise" shares a word with its relevant document only: no hard negative, no group.
    assert sorted(g.query for g in groups) == sorted([QUERIES["q1"], QUERIES["q3"]])
    for group in groups:
        qid = next(q for q, text in QUERIES.items() if text == group.query)
        positive = next(d for q, d in TRAIN if q == qid)
        assert group.passages[0] == f"{DOCS[positive][0]}\n{DOCS[positive][1]}"
        assert group.passages[1] != group.passages[0] and len(group.passages) == 2


def test_missing_train_split_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"qrels/train\.tsv"):
        read_dataset(tmp_path, "empty")


def test_training_writes_a_directory_the_reranker_loads(tmp_path: Path) -> None:
    write_beir(tmp_path, "tiny")
    config = tiny_recipe(
        groups_per_step=1,
        max_steps=2,
        max_tokens=32,
        learning_rate=1e-4,
    )
    out = tmp_path / "model"
    record = train(config, tmp_path, out, log=lambda _: None)
    assert record["steps"] == 2 and record["groups"] == {"tiny": 2}
    assert not out.with_name("model.tmp").exists()
    assert json.loads((out / "forge_training.json").read_text())["steps"] == 2
    scorer = CrossEncoderScorer(out, max_tokens=64, int8=False)
    scores = scorer.score(QUERIES["q1"], [DOCS["d1"][1], DOCS["d2"][1]])
    assert len(scores) == 2 and scores[0] != scores[1]


def test_learning_rate_warms_up_then_decays_to_zero() -> None:
    assert lr_factor(0.0, 0.1) == 0.0
    assert lr_factor(0.05, 0.1) == pytest.approx(0.5)
    assert lr_factor(0.1, 0.1) == pytest.approx(1.0)
    assert lr_factor(0.55, 0.1) == pytest.approx(0.5)
    assert lr_factor(1.0, 0.1) == 0.0 and lr_factor(1.5, 0.1) == 0.0
    assert lr_factor(0.0, 0.0) == pytest.approx(1.0)
    factors = [lr_factor(i / 100, 0.1) for i in range(101)]
    assert factors.index(max(factors)) == 10 and all(a >= b for a, b in itertools.pairwise(factors[10:]))


def test_the_head_learns_faster_and_frozen_embeddings_are_left_out() -> None:
    from transformers import BertConfig, BertForSequenceClassification

    model = BertForSequenceClassification(
        BertConfig(
            vocab_size=50,
            hidden_size=8,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=16,
            num_labels=1,
        )
    )
    model.get_input_embeddings().weight.requires_grad_(False)
    config = beir_train_recipe(learning_rate=1e-5, head_learning_rate_scale=10.0, weight_decay=0.01)
    groups = _param_groups(model, config)
    by_param = {id(p): g for g in groups for p in g["params"]}
    named = dict(model.named_parameters())
    assert id(named["bert.embeddings.word_embeddings.weight"]) not in by_param
    assert len(by_param) == sum(p.requires_grad for p in model.parameters())
    for name in ("classifier.weight", "bert.pooler.dense.weight"):
        assert by_param[id(named[name])]["lr"] == pytest.approx(1e-4)
        assert by_param[id(named[name])]["weight_decay"] == 0.01
    assert by_param[id(named["classifier.bias"])]["weight_decay"] == 0.0
    layer = "bert.encoder.layer.0.attention.output."
    assert by_param[id(named[layer + "dense.weight"])]["lr"] == pytest.approx(1e-5)
    assert by_param[id(named[layer + "LayerNorm.weight"])]["weight_decay"] == 0.0


def test_the_loop_overfits_a_few_groups_well_below_chance(tmp_path: Path) -> None:
    """The learning check: the same two groups for many steps must be learnt, which a wrong target,
    a loss over the wrong axis, a gradient never applied or a dead head would all prevent."""
    write_beir(tmp_path, "tiny")
    config = tiny_recipe(
        groups_per_step=2,
        epochs=30,
        max_steps=30,
        max_tokens=32,
        warmup_fraction=0.1,
    )
    out = tmp_path / "model"
    record = train(config, tmp_path, out, log=lambda _: None)
    assert record["steps"] == 30 and record["pairs_seen"] == 30 * 2 * 2
    assert record["chance_loss"] == pytest.approx(math.log(2), abs=1e-4)
    curve = record["loss_per_25_steps"]
    assert isinstance(curve, list) and len(curve) == 2
    assert curve[-1] < 0.25 * math.log(2)
    scorer = CrossEncoderScorer(out, max_tokens=32)
    data = read_dataset(tmp_path, "tiny")
    for group in build_groups(data, config, random.Random(config.seed)):
        scores = scorer.score(group.query, list(group.passages))
        assert scores[0] > max(scores[1:])


def test_a_spent_budget_still_publishes_the_model(tmp_path: Path) -> None:
    write_beir(tmp_path, "tiny")
    config = tiny_recipe(max_minutes=0.0)
    record = train(config, tmp_path, tmp_path / "model", log=lambda _: None)
    assert record["steps"] == 0 and (tmp_path / "model" / "config.json").is_file()


def test_positives_are_the_relevant_documents_bm25_retrieves(tmp_path: Path) -> None:
    folder = write_beir(tmp_path, "tiny")
    # d2 (bread) is judged relevant to a query about volcanic soil that BM25 never matches with it.
    with open(folder / "queries.jsonl", "a") as f:
        f.write(json.dumps({"_id": "q4", "text": "volcanic ash soil"}) + "\n")
    with open(folder / "qrels" / "train.tsv", "a") as f:
        f.write("q4\td5\t1\nq4\td2\t1\n")
    data = read_dataset(tmp_path, "tiny")
    config = tiny_recipe(10, positive_depth=5)
    positives = {
        g.passages[0] for g in build_groups(data, config, random.Random(0)) if g.query == "volcanic ash soil"
    }
    assert positives == {"Soil\nvolcanic ash makes fertile soil for farming"}
    everything = dataclasses.replace(config, positive_depth=0)
    positives = {
        g.passages[0]
        for g in build_groups(data, everything, random.Random(0))
        if g.query == "volcanic ash soil"
    }
    assert positives == {
        "Soil\nvolcanic ash makes fertile soil for farming",
        "Bread\nyeast makes bread dough rise by producing carbon dioxide",
    }
