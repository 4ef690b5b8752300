"""Decontamination and near-duplicate removal: a paraphrased GSM8K test problem copied into the
set is removed and counted under gsm8k; near duplicates within the set go, distinct problems stay."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from forge_kit.paths import data_dir
from forge_training.synthetic import dedup
from forge_training.synthetic.problems import (
    TRAIN_TEMPLATES,
    Problem,
    ProgrammaticTeacher,
    Solution,
    generate,
)
from forge_training.synthetic.verify import Verified

TASKS = Path(__file__).resolve().parents[3] / "services" / "eval" / "src" / "forge_eval" / "tasks"
GSM8K_TEST = data_dir() / "benchmarks" / "gsm8k" / "test.jsonl"


def item(pid: str, question: str, solution: str = "1+1 = <<1+1=2>>2.\n#### 2") -> Verified:
    p = Problem(pid, "add_sub", "arithmetic", "train", 1, question, (Solution(solution),), "2")
    return Verified(p, "2", p.solutions, ("ok",))


def teacher_items(n: int) -> list[Verified]:
    problems = generate(ProgrammaticTeacher(seed=4, error_rate=0.0), TRAIN_TEMPLATES, n, 1).problems
    return [Verified(p, p.reference, p.solutions, ("ok",)) for p in problems]


def test_paraphrased_gsm8k_test_problem_is_removed_and_counted(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for name in ("gsm8k.yaml", "tinyshakespeare_ppl.yaml"):
        shutil.copy(TASKS / name, tasks / name)
    sources, skipped = dedup.benchmark_sources(tasks, data_dir())
    assert [s.name for s in sources] == ["gsm8k"] and "tinyshakespeare_ppl" in skipped
    original = json.loads(GSM8K_TEST.read_text().splitlines()[0])["question"]
    paraphrase = original.replace("Janet’s ducks", "Maria's hens").replace("every morning", "each morning")
    assert paraphrase != original and dedup.jaccard(paraphrase, original) < 0.9
    ours = teacher_items(30)
    items = [*ours[:10], item("copied", paraphrase), *ours[10:]]
    report = dedup.dedup(items, dedup.Decontaminator(sources))
    assert report.by_benchmark == {"gsm8k": 1}
    assert [v.problem.id for v, _ in report.removed] == ["copied"]
    assert report.removed[0][1].startswith("benchmark gsm8k")
    assert report.counts()["removed_by_benchmark"] == {"gsm8k": 1}


def test_near_duplicates_within_the_set_are_removed() -> None:
    q = "Ana has 12 apples. Ana gets 30 more and then gives away 7. How many apples does Ana have now?"
    near = q.replace("How many apples does Ana have now?", "How many apples does Ana have now? ")
    different = q.replace("12", "13").replace("30", "31")
    report = dedup.dedup([item("a", q), item("b", near), item("c", different)], None)
    assert [v.problem.id for v in report.kept] == ["a", "c"]
    assert report.within_set == 1 and report.removed[0][1] == "duplicate of a#0"


def test_missing_benchmark_data_is_an_error(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    shutil.copy(TASKS / "gsm8k.yaml", tasks / "gsm8k.yaml")
    with pytest.raises(FileNotFoundError, match="gsm8k"):
        dedup.benchmark_sources(tasks, tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="no eval task files"):
        dedup.benchmark_sources(tmp_path, tmp_path)


def test_distinct_template_problems_survive_their_own_dedup() -> None:
    items = teacher_items(200)
    report = dedup.dedup(items, None)
    questions = [v.problem.question for v in items]
    exact = len(questions) - len(set(questions))
    assert report.within_set >= exact  # exact repeats always go
    assert len(report.kept) > 0.8 * len(items)


def test_tasks_reading_the_same_split_share_one_index_and_the_first_names_a_match() -> None:
    same = ("Ana has 12 apples and gets 30 more from her brother at the market today",) * 2
    other = ("A train leaves the station at noon and travels sixty miles every single hour",)
    sources = [
        dedup.BenchmarkSource("mmlu", same),
        dedup.BenchmarkSource("mmlu_cloze", same),
        dedup.BenchmarkSource("trains", other),
    ]
    decontaminator = dedup.Decontaminator(sources)
    assert decontaminator.indexes["mmlu"] is decontaminator.indexes["mmlu_cloze"]
    assert decontaminator.indexes["trains"] is not decontaminator.indexes["mmlu"]
    assert decontaminator.sizes == {"mmlu": 2, "mmlu_cloze": 2, "trains": 1}
    assert decontaminator.match([same[0].replace("today", "this morning")]) == ("mmlu", "mmlu:0")
    assert decontaminator.match([other[0].replace("noon", "midday")]) == ("trains", "trains:0")
    assert decontaminator.match(["Something else entirely, with no words in common at all here"]) is None
