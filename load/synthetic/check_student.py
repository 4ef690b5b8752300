"""Quick TRAIN-side check of the bench's student (no held-out figure): pre-train it as the bench
does (or load ``--student``), then greedy accuracy on fresh TRAIN-wording problems and on DEV-wording
problems (the TRAIN templates' wordings never trained on), by template.

    nice -n 10 python load/synthetic/check_student.py --work DIR [--student EXPORT] [--steps N]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import time
from pathlib import Path

from forge_training.synthetic import difficulty
from forge_training.synthetic.bench import BenchConfig, pretrain_student
from forge_training.synthetic.problems import DEV_TEMPLATES, TRAIN_TEMPLATES, ProgrammaticTeacher, generate
from forge_training.synthetic.verify import Verifier, grade


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--student", type=Path)
    ap.add_argument("--steps", type=int, default=BenchConfig.pretrain_steps)
    ap.add_argument("--problems", type=int, default=BenchConfig.pretrain_problems)
    ap.add_argument("--n", type=int, default=240)
    args = ap.parse_args()
    cfg = dataclasses.replace(BenchConfig(), pretrain_steps=args.steps, pretrain_problems=args.problems)
    verifier = Verifier("majority")
    out: dict[str, object] = {}
    student = args.student
    if student is None:
        started = time.perf_counter()
        student, figures = pretrain_student(cfg, verifier, args.work)
        out["pretrain"] = {
            **figures,
            "wall_s": round(time.perf_counter() - started, 1),
            "export": str(student),
        }
    model = difficulty.HFStudent(student)
    for name, chosen in (("train", TRAIN_TEMPLATES), ("dev", DEV_TEMPLATES)):
        teacher = ProgrammaticTeacher(seed=77, error_rate=0.0, pot_rate=0.0)
        items = verifier.verify(generate(teacher, chosen, args.n, 1).problems).kept
        prompts = [difficulty.prompt_of(v.problem.question) for v in items]
        completions = model.sample(prompts, 1, temperature=0.0, max_new_tokens=cfg.max_new_tokens, seed=0)
        right = [grade(c[0], v.answer) for c, v in zip(completions, items, strict=True)]
        by: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
        for v, ok in zip(items, right, strict=True):
            by[v.problem.template][0] += ok
            by[v.problem.template][1] += 1
        out[name] = {"accuracy": round(sum(right) / len(right), 3), "n": len(right), "by_template": dict(by)}
        out[f"{name}_examples"] = [
            (v.problem.question, c[0][:120]) for v, c in list(zip(items, completions, strict=True))[:3]
        ]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
