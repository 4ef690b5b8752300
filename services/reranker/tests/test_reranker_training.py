"""The cross-encoder training recipe on a tiny BEIR folder written here, from the real MiniLM."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from forge_reranker.scoring import CrossEncoderScorer
from forge_reranker.training import Bm25, beir_train_recipe, build_groups, read_dataset, train

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


def test_bm25_ranks_by_shared_rare_terms() -> None:
    bm25 = Bm25([f"{t} {x}" for t, x in DOCS.values()])
    assert bm25.top("sulphur dioxide eruptions", 2) == [0, 2]
    assert bm25.top("nothing matches", 3) == []


def test_groups_put_the_positive_first_and_never_a_judged_document_among_negatives(tmp_path: Path) -> None:
    write_beir(tmp_path, "tiny")
    data = read_dataset(tmp_path, "tiny")
    config = beir_train_recipe(
        datasets=("tiny",), groups_per_dataset={"tiny": 10}, negatives=1, negative_depth=5
    )
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
    config = beir_train_recipe(
        datasets=("tiny",),
        groups_per_dataset={"tiny": 3},
        negatives=1,
        negative_depth=5,
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
