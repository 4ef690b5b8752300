"""The synthetic-data workflow's stage jobs (``forge_training.synthetic.job``) over a real run folder:
the command the orchestrator builds reaches the program with every option; ``curate`` verifies
(planted errors caught, an unreadable line dropped with its reason), removes a problem that copies
a benchmark's test question and writes the student's prompts; ``band`` turns recorded platform
samples into pass rates, keeps the band and versions it (content hash, lineage, SFT file), and an
empty band writes the histogram and no dataset."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from forge_experiments.jobcmd import JobCommandError, SyntheticStageCommand
from forge_kit.testing.tiny_llama import save_tiny_llama
from forge_training.synthetic import job as synthetic_job
from forge_training.synthetic.problems import ProgrammaticTeacher, dumps, templates


def test_the_stage_command_reaches_the_program_with_every_option(tmp_path: Path) -> None:
    options = (("policy", "drop"), ("dedup-threshold", "0.9"), ("contamination-threshold", "0.5"),
               ("decontaminate", "false"), ("student", "s"), ("low", "0.2"), ("high", "0.8"))  # fmt: skip
    argv = SyntheticStageCommand("curate", str(tmp_path / "missing"), options, sys.executable).argv()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    # The program's own refusal (the folder), not argparse's: module, stage and every option understood.
    assert done.returncode == 1 and "is not a folder" in done.stderr and "usage:" not in done.stderr
    with pytest.raises(JobCommandError, match="stage"):
        SyntheticStageCommand("train", "w")
    with pytest.raises(JobCommandError, match="option name"):
        SyntheticStageCommand("band", "w", (("--low", "1"),))


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A run folder with the teacher's problems (error rate 0.4, 3 solutions each), one line that
    is no problem, and a benchmark whose test split holds one of the problems' questions."""
    work = tmp_path / "run"
    work.mkdir()
    teacher = ProgrammaticTeacher(seed=4, error_rate=0.4)
    chosen = templates(["add_sub", "unit_price"])
    problems = [teacher.write(chosen[i % 2], i, 3) for i in range(10)]
    (work / "problems.jsonl").write_text(dumps(problems) + '{"id": "x", "question": 3}\n')
    data, tasks = tmp_path / "data", tmp_path / "tasks"
    (data / "benchmarks" / "copy").mkdir(parents=True)
    tasks.mkdir()
    rows = [
        # a problem with no planted error, so that verification keeps it for dedup to remove
        {"question": next(p for p in problems if not any(s.planted for s in p.solutions)).question},
        {"question": "An unrelated question about trains and their schedules."},
    ]
    (data / "benchmarks" / "copy" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tasks / "copy.yaml").write_text(
        "name: copy\ndataset: {path: copy/test.jsonl, format: jsonl, split: test}\n"
    )
    monkeypatch.setenv("FORGE_DATA_DIR", str(data))
    monkeypatch.setenv("FORGE_EVAL_TASKS_DIR", str(tasks))
    return work


def test_curate_verifies_decontaminates_and_writes_prompts(run: Path) -> None:
    synthetic_job.main(["curate", "--work", str(run)])
    summary = json.loads((run / "curate.json").read_text())
    verify, dedup = summary["verify"], summary["dedup"]
    assert verify["unreadable"] == {"unreadable: ValueError": 1} and verify["problems"] == 10
    assert sum(n for status, n in verify["solutions_by_status"].items() if status != "ok") > 0
    assert dedup["removed_by_benchmark"] == {"copy": 1} and dedup["decontaminated_against"] == ["copy"]
    assert summary["kept"] == dedup["kept"] == verify["kept"] - 1
    prompts = [json.loads(line) for line in (run / "prompts.jsonl").read_text().splitlines()]
    assert len(prompts) == summary["kept"] and all(
        p["prompt"].rstrip().endswith("Assistant:") for p in prompts
    )
    assert any(e["reason"].startswith("benchmark copy") for e in summary["removed_examples"])


def test_band_keeps_the_band_and_versions_it_or_reports_an_empty_one(run: Path, tmp_path: Path) -> None:
    student = save_tiny_llama(tmp_path / "student", context=256)
    synthetic_job.main(["curate", "--work", str(run), "--decontaminate", "false"])
    curated = synthetic_job.read_curated(run / "curated.jsonl")
    # Recorded answers: problem i answered right in i % 5 of 4 samples (pass rates 0, .25, .5, .75, 1).
    rows = [
        {"id": v.problem.id, "completions": [f"#### {v.answer}"] * (i % 5) + ["#### -1"] * (4 - i % 5)}
        for i, v in enumerate(curated)
    ]
    (run / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    synthetic_job.main(
        ["band", "--work", str(run), "--student", str(student), "--low", "0.2", "--high", "0.8"]
    )
    band = json.loads((run / "band.json").read_text())
    expected = sum(1 for i in range(len(curated)) if 1 <= i % 5 <= 3)
    assert band["counts"]["kept"] == expected > 0 and sum(band["histogram"].values()) == len(curated)
    lineage = json.loads(Path(band["dataset"]["lineage"]).read_text())
    assert lineage["content_hash"] == band["dataset"]["content_hash"] and lineage["problems"] == expected
    assert lineage["stages"]["curate"]["kept"] == len(curated) and band["dataset"]["tokens"] > 0
    assert band["sft_overrides"] == [f"pairs.path={run / 'dataset' / 'sft.jsonl'}"]
    # Nobody solves anything: the band is empty, the histogram says where they all are.
    (run / "samples.jsonl").write_text(
        "".join(json.dumps({**r, "completions": ["#### -1"] * 4}) + "\n" for r in rows)
    )
    synthetic_job.main(
        ["band", "--work", str(run), "--student", str(student), "--low", "0.2", "--high", "0.8"]
    )
    empty = json.loads((run / "band.json").read_text())
    assert empty["dataset"] == {} and empty["counts"]["kept"] == 0
    assert empty["histogram"]["0.0-0.1"] == len(curated) == empty["counts"]["below_band"]


def test_the_grading_steps_start_without_torch() -> None:
    """``curate`` and ``band`` grade text (the student's samples were recorded by the workflow):
    what they import leaves torch out, a few seconds less for each step's process."""
    code = (
        "import sys\n"
        "from forge_training.synthetic import job, dataset, dedup, difficulty, verify\n"
        "from forge_training.synthetic.dedup import Decontaminator, benchmark_sources, default_tasks_dir\n"
        "from forge_training.synthetic.difficulty import EmptyBandError, band_filter, pass_rates, prompt_of\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"
