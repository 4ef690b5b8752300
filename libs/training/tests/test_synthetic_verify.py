"""The verifier: answers with tolerance and SymPy, calculator annotations, programs-of-thought in
the real sandbox (one that reads a file it was not given fails), a throwing check drops the
problem with its reason, and the drop / majority policies."""

from __future__ import annotations

from pathlib import Path

import pytest

from forge_kit import sandbox
from forge_training.synthetic.problems import Problem, Solution
from forge_training.synthetic.verify import Verifier, grade, numbers_match, parse_answer


def problem(*texts: str, programs: tuple[str, ...] = ()) -> Problem:
    sols = tuple(Solution(t, programs[i] if i < len(programs) else "") for i, t in enumerate(texts))
    return Problem("p1", "add_sub", "arithmetic", "train", 1, "Ann has 2 and gets 3. How many?", sols, "5")


def no_programs(source: str) -> sandbox.SandboxResult:
    raise AssertionError("no program should run")


RIGHT = "2+3 = <<2+3=5>>5.\n#### 5"


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ("5", "5.0", True),
        ("1,234", "$1234", True),
        ("3/4", "0.75", True),
        ("0.33", "1/3", True),  # a 2-place decimal matches what rounds to it
        ("0.3", "1/3", True),
        ("0.34", "1/3", False),
        ("25%", "0.25", True),
        ("25%", "25", True),
        ("1000000", "1000001", False),  # integers compare exactly, not relatively
        ("2*sqrt(2)", "sqrt(8)", True),
        ("2^10", "1024", True),
        ("-7", "7", False),
    ],
)
def test_numbers_match_tolerance_rules(a: str, b: str, same: bool) -> None:
    x, y = parse_answer(a), parse_answer(b)
    assert x is not None and y is not None
    assert numbers_match(x, y) is same


@pytest.mark.parametrize(
    "text", ["", "about 5", "5 or so", "x+1", "__import__('os')", "9**9**9", "1/0", "9" * 80]
)
def test_unparseable_answers_are_refused(text: str) -> None:
    assert parse_answer(text) is None


def test_right_wrong_and_malformed_solutions() -> None:
    v = Verifier(run_program=no_programs)
    assert v.check_solution(Solution(RIGHT)).status == "ok"
    assert v.check_solution(Solution("2+3 = <<2+3=6>>6.\n#### 6")).status == "bad_step"
    assert v.check_solution(Solution("2+3 = <<2+3=5>>5.\n#### about five")).status == "malformed"
    assert v.check_solution(Solution("2+3 = <<2+3=5>>5.")).status == "malformed"
    assert grade(" 2+3 = 5.\n#### 5.0", "5") and not grade(" 2+3 = 5.\n#### 6", "5")


def test_policies_on_disagreement() -> None:
    wrong_final = "2+3 = <<2+3=5>>5.\n#### 6"
    two_to_one = problem(RIGHT, RIGHT, wrong_final)
    kept = Verifier("majority", run_program=no_programs).verify([two_to_one])
    assert [k.answer for k in kept.kept] == ["5"] and len(kept.kept[0].solutions) == 2
    dropped = Verifier("drop", run_program=no_programs).verify([two_to_one])
    assert not dropped.kept and dropped.dropped[0].reason.startswith("disagreement")
    tie = Verifier("majority", run_program=no_programs).verify([problem(RIGHT, wrong_final)])
    assert tie.dropped[0].reason.startswith("no_majority")
    none = Verifier("majority", run_program=no_programs).verify([problem("#### ?", "#### ")])
    assert none.dropped[0].reason == "no_valid_solution"
    assert none.counts()["dropped_by_reason"] == {"no_valid_solution": 1}


def test_a_throwing_check_drops_the_problem_with_its_reason() -> None:
    def broken(source: str) -> sandbox.SandboxResult:
        raise RuntimeError("sandbox exploded")

    report = Verifier(run_program=broken).verify([problem(RIGHT, programs=("print(5)\n",)), problem(RIGHT)])
    assert len(report.kept) == 1
    assert report.dropped[0].reason == "verifier_error: RuntimeError: sandbox exploded"


def test_programs_of_thought_run_in_the_sandbox(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("5\n")
    v = Verifier("drop")
    assert v.check_solution(Solution(RIGHT, "s0 = 2+3\nprint(s0)\n")).status == "ok"
    assert v.check_solution(Solution(RIGHT, "print(2*3)\n")).status == "program_mismatch"
    assert v.check_solution(Solution(RIGHT, "raise SystemExit(1)\n")).status == "program_failed"
    reader = v.check_solution(Solution(RIGHT, f"print(open({str(secret)!r}).read())\n"))
    assert reader.status == "program_failed" and "No such file" in reader.detail
