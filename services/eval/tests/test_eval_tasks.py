"""Task YAML files: the shipped tasks load and render from the shared data; bad task files are
refused naming the field."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from forge_eval.task_runner import TaskCatalog
from forge_eval.tasks import DataRoots, build_docs, dataset_hash, load_records, load_task, shipped_tasks
from forge_kit import errors
from forge_kit.paths import resolve_data_path

ROOTS = DataRoots(resolve_data_path("benchmarks"), resolve_data_path("corpora"))


#: Tasks whose data is generated (``python -m forge_eval.vlm_data``), checked in test_eval_vlm.py.
GENERATED = {"vlm_shapes_vqa", "vlm_shapes_vqa_text_only", "vlm_shapes_caption"}


def test_every_shipped_task_loads_and_pins_its_data() -> None:
    assert (
        set(shipped_tasks())
        == {
            "gsm8k",
            "mmlu",
            "mmlu_cloze",
            "bbh",
            "bbh_cot",
            "humaneval",
            "tinyshakespeare_ppl",
            "scifact_ppl",
        }
        | GENERATED
    )
    for name in shipped_tasks():
        task = load_task(name)
        assert task.dataset.sha256, f"{name} pins no dataset hash"
        if name not in GENERATED:
            dataset_hash(ROOTS, task.dataset)


def test_gsm8k_renders_five_shots_deterministically_per_example() -> None:
    task = load_task("gsm8k")
    docs = build_docs(task, ROOTS, limit=4, seed=3)
    again = build_docs(task, ROOTS, limit=2, seed=3)
    assert len(docs) == 4 and all(len(d.shots) == 5 for d in docs)
    by_id = {d.id: d for d in docs}
    # A doc's shots depend on the few-shot seed and its id only, not on which other docs run.
    for doc in again:
        if doc.id in by_id:
            assert doc.prompt == by_id[doc.id].prompt
    assert docs[0].prompt.endswith("Answer:") and "####" in docs[0].shots[0]
    assert docs[0].target.replace("-", "").isdigit()


def test_mmlu_draws_shots_from_the_same_subject_and_smoke_covers_every_subject() -> None:
    task = load_task("mmlu")
    docs = build_docs(task, ROOTS, smoke=True)
    assert len(docs) == task.smoke.size
    subjects = Counter(d.record["_source"] for d in docs)
    assert len(subjects) == 57
    doc = docs[0]
    assert doc.choices == (" A", " B", " C", " D") and 0 <= doc.gold < 4
    assert len(doc.shots) == 5


def test_smoke_tier_is_a_seeded_stratified_subset() -> None:
    task = load_task("bbh")  # 27 subtasks of different sizes
    docs = build_docs(task, ROOTS, smoke=True, seed=0)
    records = Counter(r["_source"] for r in load_records(ROOTS, task.dataset))
    picked = Counter(d.record["_source"] for d in docs)
    assert len(docs) == task.smoke.size and set(picked) == set(records)
    total = sum(records.values())
    for subtask, n in records.items():  # each subtask keeps its share (largest remainder)
        assert abs(picked[subtask] - task.smoke.size * n / total) < 1
    assert [d.id for d in build_docs(task, ROOTS, smoke=True, seed=0)] == [d.id for d in docs]
    assert {d.id for d in build_docs(task, ROOTS, smoke=True, seed=1)} != {d.id for d in docs}


def test_smoke_stratified_by_a_missing_field_is_refused(tmp_path: Path) -> None:
    task = load_task(_write(tmp_path, BASE + "smoke: {size: 5, stratify_by: subject}\n"))
    with pytest.raises(errors.ValidationError) as info:
        build_docs(task, ROOTS, smoke=True)
    assert info.value.field == "task.smoke.stratify_by" and "answer, question" in str(info.value)


def test_bbh_and_humaneval_render() -> None:
    bbh = build_docs(load_task("bbh"), ROOTS, limit=30, seed=1)
    assert all(d.prompt.startswith("Q: ") and d.target for d in bbh)
    humaneval = build_docs(load_task("humaneval"), ROOTS, limit=3)
    assert all(d.id.startswith("HumanEval/") and "def " in d.prompt for d in humaneval)


def _write(tmp: Path, body: str) -> str:
    path = tmp / "t.yaml"
    path.write_text(body)
    return str(path)


BASE = "name: t\noutput_type: generate_until\ndataset: {path: gsm8k/test.jsonl}\ntemplate: {prompt: 'Q: {{ question }}'}\nscorer: {name: gsm8k}\n"


def test_unknown_key_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(errors.ValidationError) as info:
        load_task(_write(tmp_path, BASE + "temprature: 0.5\n"))
    assert info.value.field == "task.temprature" and "unknown key" in str(info.value)
    with pytest.raises(errors.ValidationError) as nested:
        load_task(_write(tmp_path, BASE.replace("{prompt:", "{promt: x, prompt:")))
    assert nested.value.field == "task.template.promt"


def test_missing_dataset_and_changed_data_are_refused(tmp_path: Path) -> None:
    missing = load_task(_write(tmp_path, BASE.replace("gsm8k/test.jsonl", "gsm8k/nope.jsonl")))
    with pytest.raises(errors.ValidationError) as info:
        build_docs(missing, ROOTS)
    assert info.value.field == "task.dataset.path"
    pinned = load_task(
        _write(tmp_path, BASE.replace("gsm8k/test.jsonl}", "gsm8k/test.jsonl, sha256: 0123abcd}"))
    )
    with pytest.raises(errors.ValidationError) as changed:
        dataset_hash(ROOTS, pinned.dataset)
    assert changed.value.field == "task.dataset.sha256" and "3730d312f6e34405" in str(changed.value)


def test_template_with_a_missing_field_is_refused(tmp_path: Path) -> None:
    task = load_task(_write(tmp_path, BASE.replace("{{ question }}", "{{ questoin }}")))
    with pytest.raises(errors.ValidationError) as info:
        build_docs(task, ROOTS, limit=2)
    assert info.value.field == "task.template.prompt" and "questoin" in str(info.value)
    assert "question" in str(info.value)


def test_scorer_must_fit_the_output_type(tmp_path: Path) -> None:
    from forge_eval.scorers import get_scorer

    with pytest.raises(errors.ValidationError) as info:
        get_scorer("multiple_choice_loglikelihood", "generate_until")
    assert info.value.field == "task.output_type"
    with pytest.raises(errors.ValidationError):
        load_task(_write(tmp_path, BASE.replace("generate_until", "multiple_choice")))


def test_the_service_catalog_is_the_shipped_tasks_with_their_data_hashes() -> None:
    catalog = TaskCatalog(ROOTS)
    # the vlm_shapes_* data is generated by `make data` (python -m forge_eval.vlm_data)
    assert catalog.suites() == [
        "bbh", "bbh_cot", "gsm8k", "humaneval", "mmlu", "mmlu_cloze", "scifact_ppl", "tinyshakespeare_ppl",
        "vlm_shapes_caption", "vlm_shapes_vqa", "vlm_shapes_vqa_text_only",
    ]  # fmt: skip
    hashes = catalog.dataset_hashes("gsm8k")
    assert hashes["benchmarks/gsm8k/test.jsonl"].startswith("3730d312f6e34405")
    assert hashes["benchmarks/gsm8k/train.jsonl"].startswith("17f347dc51477c50")
    assert list(catalog.dataset_hashes("tinyshakespeare_ppl")) == ["corpora/tinyshakespeare/input.txt"]


def test_scifact_ppl_scores_the_held_out_tail_of_the_abstracts_as_the_trainer_reads_them() -> None:
    task = load_task("scifact_ppl")
    every = load_records(ROOTS, task.dataset.model_copy(update={"slice": (0.0, 1.0)}))
    tail = load_records(ROOTS, task.dataset)
    assert len(every) == 5183 and len(tail) == len(every) - int(len(every) * 0.9)
    assert [r["_id"] for r in tail] == [r["_id"] for r in every[int(len(every) * 0.9) :]]
    docs = build_docs(task, ROOTS, limit=3, seed=0)
    first = tail[docs[0].record["_index"]]
    assert docs[0].id == f"scifact:{first['_id']}" and docs[0].prompt == f"{first['title']}\n{first['text']}"
