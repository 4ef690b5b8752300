"""The TRAIN templates' paraphrased wordings: many per template, DEV wordings apart from the TRAIN
ones, and every one kept apart from the HELD-OUT templates' wordings (the measure)."""

from __future__ import annotations

import hashlib
import re

import pytest

from forge_training.synthetic import problems as P
from forge_training.synthetic import wordings as W
from forge_training.synthetic.verify import Verifier


def _masked(text: str) -> list[str]:
    return ["N" if w.isdigit() else w for w in re.findall(r"[a-z]+|\d+", text.lower())]


def _grams(text: str, n: int) -> set[tuple[str, ...]]:
    words = _masked(text)
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def _sentences(text: str) -> list[str]:
    return [" ".join(_masked(s)) for s in re.split(r"(?<=[.?])\s+", text) if _masked(s)]


@pytest.fixture(scope="module")
def questions() -> dict[str, list[P.Problem]]:
    teacher = P.ProgrammaticTeacher(seed=3, error_rate=0.0, pot_rate=0.0)
    return {
        "train": P.generate(teacher, P.TRAIN_TEMPLATES, 3000, 1).problems,
        "dev": P.generate(teacher, P.DEV_TEMPLATES, 800, 1).problems,
        "held_out": P.generate(teacher, P.HELD_OUT_TEMPLATES, 600, 1).problems,
    }


def test_each_train_template_has_many_wordings_and_dev_ones_apart() -> None:
    for template in W.FRAMES:
        train, dev = W.wordings(template, "train"), W.wordings(template, "dev")
        assert len(train) >= 30 and len(dev) >= 1
        assert not set(train) & set(dev)
    with pytest.raises(ValueError, match="pool"):
        W.frames("add_sub", "test")


def test_no_train_or_dev_wording_overlaps_a_held_out_one(questions: dict[str, list[P.Problem]]) -> None:
    held = questions["held_out"]
    held_sentences = {s for p in held for s in _sentences(p.question)}
    held_grams = set().union(*(_grams(p.question, 8) for p in held))
    for p in questions["train"] + questions["dev"]:
        mine = _sentences(p.question)
        # no sentence equals, contains or sits inside a held-out sentence
        assert not any(a in b or b in a for a in mine for b in held_sentences), p.question
        assert not _grams(p.question, 8) & held_grams, p.question
        assert not set(_masked(p.question)) & set(W.HELD_OUT_NOUNS), p.question


def test_train_and_dev_questions_are_solvable_and_differ(questions: dict[str, list[P.Problem]]) -> None:
    train, dev = questions["train"], questions["dev"]
    assert {p.template for p in dev} == {f"{t.id}_dev" for t in P.TRAIN_TEMPLATES}
    assert not {" ".join(_masked(p.question)) for p in train} & {" ".join(_masked(p.question)) for p in dev}
    assert len({" ".join(_masked(p.question)) for p in train}) > 1000
    assert all("{" not in p.question and "}" not in p.question for p in train + dev)
    kept = Verifier("majority", run_program=lambda s: (_ for _ in ()).throw(AssertionError)).verify(dev)
    assert len(kept.kept) == len(dev)
    assert all(v.answer == v.problem.reference for v in kept.kept)


def test_held_out_problems_are_unchanged() -> None:
    """The bench's held-out problems (seed 2000, 1000 problems, k = 4) are those of runs 1-4."""
    teacher = P.ProgrammaticTeacher(seed=2000, error_rate=0.2, pot_rate=0.1)
    held = P.generate(teacher, P.HELD_OUT_TEMPLATES, 1000, 4).problems
    assert held[0].question == (
        "A bus carries 2 people. At a stop 2 people board and later 1 leave. "
        "How many people are on the bus at the end?"
    )
    digest = hashlib.sha256(P.dumps(held).encode()).hexdigest()
    assert digest == "05758208b5160f19ef82e451e307c95977cde2f3e34924787104207f5f1ab52d"
