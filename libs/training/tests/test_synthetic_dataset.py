"""The written data set: the content hash and lineage are stable and change with the content;
the sft task's loader reads every row; the token shards hold the conversations."""

from __future__ import annotations

import json
from pathlib import Path

from forge_training.data import TokenShards, train_tokenizer
from forge_training.pairs import load_pairs
from forge_training.schema import PairsConfig
from forge_training.synthetic import dataset
from forge_training.synthetic.problems import TRAIN_TEMPLATES, ProgrammaticTeacher, generate
from forge_training.synthetic.verify import Verified, Verifier

LINEAGE = {
    "teacher": {"name": "programmatic-v1"},
    "templates": ["add_sub"],
    "seed": 3,
    "stages": {"verify": 1},
}


def kept(seed: int = 3, n: int = 24) -> list[Verified]:
    problems = generate(
        ProgrammaticTeacher(seed=seed, error_rate=0.3, pot_rate=0.0), TRAIN_TEMPLATES, n, 3
    ).problems
    return (
        Verifier("majority", run_program=lambda s: (_ for _ in ()).throw(AssertionError))
        .verify(problems)
        .kept
    )


def test_hash_and_lineage_are_stable_and_follow_the_content(tmp_path: Path) -> None:
    items = kept()
    tok = train_tokenizer(
        "".join(dataset.chat_text(v.problem.question, v.solutions[0].plain()) for v in items), 300
    )
    a = dataset.write_dataset(tmp_path / "a", items, LINEAGE, tokenizer=tok)
    b = dataset.write_dataset(tmp_path / "b", items, LINEAGE, tokenizer=tok)
    assert a.content_hash == b.content_hash == dataset.content_hash(items)
    assert (tmp_path / "a" / "lineage.json").read_text() == (tmp_path / "b" / "lineage.json").read_text()
    c = dataset.write_dataset(tmp_path / "c", items[:-1], LINEAGE)
    assert c.content_hash != a.content_hash
    lineage = json.loads((tmp_path / "a" / "lineage.json").read_text())
    assert (
        lineage["teacher"] == LINEAGE["teacher"]
        and lineage["seed"] == 3
        and lineage["problems"] == len(items)
    )
    assert set(lineage["files"]) == {"problems.jsonl", "sft.jsonl", "tokens/index.json"}
    shards = TokenShards(tmp_path / "a" / "tokens")
    assert shards.total_tokens == a.tokens > 0
    assert tok.decode(shards.read(0, 200).tolist()).startswith("User: ")


def test_the_sft_task_reads_every_row(tmp_path: Path) -> None:
    items = kept(n=40)
    dataset.write_dataset(tmp_path, items, LINEAGE)
    train, val = load_pairs(PairsConfig(path=str(tmp_path / "sft.jsonl")), seed=0, val_fraction=0.1)
    assert len(train) + len(val) == len(items)
    first = next(p for p in train + val if p.prompt[0][1] == items[0].problem.question)
    assert first.chosen == items[0].solutions[0].plain().strip() and "<<" not in first.chosen
    assert first.rejected != first.chosen
