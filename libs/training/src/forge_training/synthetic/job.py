"""The jobs of the synthetic-data workflow: one stage over the run's folder per call.

The orchestrator's ``synthetic`` workflow (``services/orchestrator/.../synthetic/workflow.py``)
submits each stage as a scheduler job (:class:`forge_experiments.jobcmd.SyntheticStageCommand`); the
stage reads and writes files in ``--work`` (the run's folder, shared with the orchestrator) and
writes ``<stage>.json`` last, its summary, which the workflow reads back. A stage re-run over the
same folder writes the same files.

- ``curate``: ``problems.jsonl`` (the teacher's problems, :mod:`~forge_training.synthetic.problems`
  format) → verified (:class:`~forge_training.synthetic.verify.Verifier`, ``--policy``), deduplicated
  within the set and decontaminated against every eval benchmark's test split
  (:mod:`~forge_training.synthetic.dedup`) → ``curated.jsonl`` and the student's prompts
  ``prompts.jsonl`` (``{"id", "prompt"}``). An unreadable line is dropped with its reason.
- ``band``: ``curated.jsonl`` and the student's samples ``samples.jsonl`` (written by the
  workflow's sampling activity through the platform) → pass rates, their histogram and the band
  ``[--low, --high]`` (:mod:`~forge_training.synthetic.difficulty`, with a student that replays the
  recorded samples); a non-empty band is written as the versioned dataset
  (:mod:`~forge_training.synthetic.dataset`: token shards, the SFT file, content hash, lineage).
- ``heldout``: problems of ``--templates`` (held out of training; the programmatic writer, so
  their answers are exact) answered greedily by ``--base`` and ``--tuned``: accuracy with its
  Wilson interval for each, and the paired difference with its bootstrap interval.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from forge_training.synthetic.problems import Problem

MAX_LINE_CHARS = 64 * 1024


def _write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temporary name, then rename)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def _summary(work: Path, stage: str, data: dict[str, Any]) -> None:
    _write(work / f"{stage}.json", json.dumps(data, indent=2, sort_keys=True))


def read_problems(path: Path) -> tuple[list[Problem], dict[str, int]]:
    """The problems of a JSON-lines file; lines that are not problems are counted by reason."""
    problems: list[Problem] = []
    bad: dict[str, int] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            if len(line) > MAX_LINE_CHARS:
                raise ValueError("line too long")
            problems.append(Problem.from_json(json.loads(line)))
        except (ValueError, TypeError) as exc:
            reason = f"unreadable: {type(exc).__name__}"
            bad[reason] = bad.get(reason, 0) + 1
    return problems, bad


# --- curate --------------------------------------------------------------------------------------


def curate(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    from forge_kit.paths import data_path
    from forge_training.synthetic.dataset import problems_jsonl
    from forge_training.synthetic.dedup import Decontaminator, benchmark_sources, dedup, default_tasks_dir
    from forge_training.synthetic.difficulty import prompt_of
    from forge_training.synthetic.verify import Verifier

    problems, unreadable = read_problems(work / "problems.jsonl")
    report = Verifier(args.policy).verify(problems)
    decontaminator = None
    skipped: dict[str, str] = {}
    if args.decontaminate == "true":
        sources, skipped = benchmark_sources(Path(args.eval_tasks or default_tasks_dir()), data_path())
        decontaminator = Decontaminator(sources, threshold=args.contamination_threshold)
    deduped = dedup(report.kept, decontaminator, within_threshold=args.dedup_threshold)
    _write(work / "curated.jsonl", problems_jsonl(deduped.kept))
    prompts = [{"id": v.problem.id, "prompt": prompt_of(v.problem.question)} for v in deduped.kept]
    _write(work / "prompts.jsonl", "".join(json.dumps(p) + "\n" for p in prompts))
    verify_counts = report.counts()
    if unreadable:
        verify_counts["unreadable"] = unreadable
    examples = [{"id": d.problem.id, "reason": d.reason} for d in report.dropped[:20]]
    examples += [{"id": v.problem.id, "reason": why} for v, why in deduped.removed[:20]]
    return {
        "verify": verify_counts,
        "dedup": {**deduped.counts(), "decontaminated_against": sorted(decontaminator.indexes) if decontaminator else [],
                  "skipped_tasks": skipped},
        "kept": len(deduped.kept),
        "removed_examples": examples,
    }  # fmt: skip


# --- band and dataset ----------------------------------------------------------------------------


class RecordedStudent:
    """The :class:`~forge_training.synthetic.difficulty.Student` whose answers were sampled through
    the platform (the workflow's sampling activity, at the student's OpenAI-compatible endpoint)
    and recorded in ``samples.jsonl``: it replays them, prompt by prompt."""

    def __init__(self, name: str, recorded: dict[str, list[str]]) -> None:
        self.name = name
        self._recorded = recorded

    def sample(
        self, prompts: Sequence[str], n: int, *, temperature: float, max_new_tokens: int, seed: int
    ) -> list[list[str]]:
        out = []
        for prompt in prompts:
            got = self._recorded[prompt]
            if len(got) != n:
                raise ValueError(f"{len(got)} recorded samples of a prompt, {n} asked for")
            out.append(list(got))
        return out


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


def read_curated(path: Path) -> list[Any]:
    """The verified problems ``curate`` kept (:func:`~forge_training.synthetic.dataset.problem_record` rows)."""
    from forge_training.synthetic.verify import Verified

    items = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            problem = Problem.from_json(row)
            kept = set(row["kept_solutions"])
            solutions = tuple(s for s in problem.solutions if s.text in kept)
            items.append(Verified(problem, str(row["answer"]), solutions, ()))
    return items


def band(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    from tokenizers import Tokenizer

    from forge_training.synthetic.dataset import LINEAGE_FILE, write_dataset
    from forge_training.synthetic.difficulty import EmptyBandError, band_filter, pass_rates, prompt_of

    items = read_curated(work / "curated.jsonl")
    samples: dict[str, list[str]] = {}
    for line in (work / "samples.jsonl").read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            samples[str(row["id"])] = [str(c) for c in row["completions"]]
    # A problem the student could not be asked (refused by its endpoint) has no pass rate.
    sampled = [v for v in items if v.problem.id in samples]
    n = len(samples[sampled[0].problem.id]) if sampled else 0
    counts: dict[str, Any] = {"in": len(items), "unsampled": len(items) - len(sampled), "samples": n}
    if not sampled:
        return {"histogram": {}, "counts": {**counts, "kept": 0}, "dataset": {}}
    student = RecordedStudent(
        args.student, {prompt_of(v.problem.question): samples[v.problem.id] for v in sampled}
    )
    rates = pass_rates(student, sampled, n, temperature=1.0, max_new_tokens=0, seed=0)
    try:
        result = band_filter(sampled, rates, args.low, args.high)
    except EmptyBandError as exc:
        below = sum(r < args.low for r in rates)
        return {
            "histogram": exc.histogram,
            "counts": {**counts, "kept": 0, "below_band": below, "above_band": len(rates) - below},
            "dataset": {},
        }
    lineage = {
        "run": _read_json(work / "run.json"),
        "stages": {
            "generate": _read_json(work / "generate.json"),
            "curate": {k: v for k, v in _read_json(work / "curate.json").items() if k != "removed_examples"},
            "student": _read_json(work / "sample.json"),
            "band": {**counts, **result.counts()},
        },
    }
    tokenizer = Tokenizer.from_file(str(Path(args.student) / "tokenizer.json"))
    written = write_dataset(work / "dataset", result.kept, lineage, tokenizer=tokenizer)
    return {
        "histogram": result.histogram,
        "counts": {**counts, **{k: v for k, v in result.counts().items() if k != "histogram"}},
        "dataset": {
            "uri": str(written.root),
            "content_hash": written.content_hash,
            "problems": written.problems,
            "sft_rows": written.sft_rows,
            "tokens": written.tokens,
            "lineage": str(written.root / LINEAGE_FILE),
        },
        "sft_overrides": [f"pairs.path={written.root / 'sft.jsonl'}"],
    }


# --- held-out evaluation -------------------------------------------------------------------------


def heldout(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    from forge_kit.stats import paired_compare, wilson_interval
    from forge_training.synthetic.difficulty import prompt_of
    from forge_training.synthetic.problems import ProgrammaticTeacher, templates
    from forge_training.synthetic.student import HFStudent
    from forge_training.synthetic.verify import grade

    chosen = templates([t for t in args.templates.split(",") if t])
    writer = ProgrammaticTeacher(seed=args.seed, error_rate=0.0)
    problems = [writer.write(chosen[i % len(chosen)], i, 1) for i in range(args.problems)]
    prompts = [prompt_of(p.question) for p in problems]
    out: dict[str, Any] = {"problems": len(problems), "templates": [t.id for t in chosen]}
    scores: dict[str, list[float]] = {}
    for side in ("base", "tuned"):
        folder = Path(getattr(args, side))
        context = int(json.loads((folder / "config.json").read_text()).get("max_position_embeddings", 2048))
        student = HFStudent(folder, max_prompt_tokens=max(16, context - args.max_new_tokens))
        answers = student.sample(
            prompts, 1, temperature=0.0, max_new_tokens=args.max_new_tokens, seed=args.seed
        )
        scores[side] = [float(grade(a[0], p.reference)) for a, p in zip(answers, problems, strict=True)]
        right = sum(scores[side])
        low, high = wilson_interval(right, len(problems))
        out[side] = {
            "accuracy": right / len(problems),
            "ci95": [round(low, 6), round(high, 6)],
            "n": len(problems),
        }
    compared = paired_compare(scores["base"], scores["tuned"])
    out["delta"] = {"value": compared.delta, "ci95": [compared.ci_low, compared.ci_high]}
    return out


STAGES = {"curate": curate, "band": band, "heldout": heldout}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="One stage of the synthetic-data workflow.")
    parser.add_argument("stage", choices=["curate", "band", "heldout"])
    parser.add_argument("--work", required=True, help="The run's folder (shared with the orchestrator).")
    parser.add_argument("--policy", default="majority", choices=["majority", "drop"])
    parser.add_argument("--dedup-threshold", type=float, default=0.9)
    parser.add_argument("--contamination-threshold", type=float, default=0.5)
    parser.add_argument("--decontaminate", default="true", choices=["true", "false"])
    parser.add_argument(
        "--eval-tasks", default="", help="The eval service's task folder (default: the checkout's)."
    )
    parser.add_argument(
        "--student", default="", help="The student's checkpoint (its tokenizer writes the shards)."
    )
    parser.add_argument("--low", type=float, default=0.2)
    parser.add_argument("--high", type=float, default=0.8)
    parser.add_argument("--base", default="")
    parser.add_argument("--tuned", default="")
    parser.add_argument("--templates", default="")
    parser.add_argument("--problems", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args(argv)
    work = Path(args.work)
    if not work.is_dir():
        sys.exit(f"--work {work} is not a folder")
    summary = STAGES[args.stage](work, args)
    _summary(work, args.stage, summary)
    print(json.dumps({k: v for k, v in summary.items() if k != "removed_examples"}, sort_keys=True))


if __name__ == "__main__":
    main()
