"""The programmatic teacher: deterministic from its seed, JSON round-trip, error rate roughly
honoured, and what the verifier catches of its planted errors."""

from __future__ import annotations

import pytest

from forge_training.synthetic import problems as P
from forge_training.synthetic.verify import Verifier


def test_teacher_is_deterministic_and_round_trips() -> None:
    a = P.generate(P.ProgrammaticTeacher(seed=7), P.TRAIN_TEMPLATES, 40, 3).problems
    b = P.generate(P.ProgrammaticTeacher(seed=7), P.TRAIN_TEMPLATES, 40, 3).problems
    c = P.generate(P.ProgrammaticTeacher(seed=8), P.TRAIN_TEMPLATES, 40, 3).problems
    assert a == b and a != c
    assert P.loads(P.dumps(a)) == a
    assert {p.template for p in a} == {t.id for t in P.TRAIN_TEMPLATES}
    assert all(p.solutions[0].text.splitlines()[-1].startswith("#### ") for p in a)


def test_train_and_held_out_templates_are_disjoint() -> None:
    train = {t.id for t in P.TRAIN_TEMPLATES}
    held = {t.id for t in P.HELD_OUT_TEMPLATES}
    assert train and held and not train & held
    held_problems = P.generate(P.ProgrammaticTeacher(), P.HELD_OUT_TEMPLATES, 12, 1).problems
    assert {p.split for p in held_problems} == {"held_out"}


@pytest.mark.parametrize("rate", [0.0, 0.3])
def test_error_rate_is_roughly_honoured_and_caught(rate: float) -> None:
    teacher = P.ProgrammaticTeacher(seed=1, error_rate=rate, pot_rate=0.0)
    problems = P.generate(teacher, P.TRAIN_TEMPLATES, 300, 4).problems
    solutions = [s for p in problems for s in p.solutions]
    planted = sum(bool(s.planted) for s in solutions) / len(solutions)
    assert abs(planted - rate) < 0.04  # 1200 draws: 4 standard errors
    report = Verifier("majority", run_program=lambda s: (_ for _ in ()).throw(AssertionError)).verify(
        problems
    )
    status = report.solution_status
    if rate == 0.0:
        assert status == {"ok": 1200} and len(report.kept) == 300
        return
    arithmetic = sum(s.planted == "arithmetic" for s in solutions)
    malformed = sum(s.planted == "malformed" for s in solutions)
    assert status["bad_step"] == arithmetic and status["malformed"] == malformed
    wrong = [v for v in report.kept if v.answer != v.problem.reference]
    # the verifier's known blind spot: a wrong final answer as the only readable solution
    assert len(wrong) < 0.02 * len(report.kept)
    assert all({s.planted for s in v.solutions} == {"final"} for v in wrong)


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="error_rate"):
        P.ProgrammaticTeacher(error_rate=1.5)
    with pytest.raises(ValueError, match="unknown templates"):
        P.templates(["nope"])
    with pytest.raises(ValueError, match="missing or wrong field"):
        P.Problem.from_json({"id": "x"})
    row = P.generate(P.ProgrammaticTeacher(), P.TRAIN_TEMPLATES, 1, 1).problems[0].to_json()
    row["question"] = "x" * (P.MAX_TEXT_CHARS + 1)
    with pytest.raises(ValueError, match="longer than"):
        P.Problem.from_json(row)


def test_teacher_failures_are_retried_and_counted() -> None:
    class Flaky:
        name = "flaky"

        def __init__(self) -> None:
            self.calls = 0

        def write(self, template: P.Template, index: int, k: int) -> P.Problem:
            self.calls += 1
            if index % 2:
                raise P.TeacherError("malformed: no #### line")
            return P.ProgrammaticTeacher().write(template, index, k)

    flaky = Flaky()
    report = P.generate(flaky, P.TRAIN_TEMPLATES, 6, 2, retries=2)
    assert len(report.problems) == 3 and report.failures == {"malformed": 9} and flaky.calls == 12
