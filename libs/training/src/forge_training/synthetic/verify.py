"""Verifying worked solutions: final answers numerically (SymPy), calculator annotations
recomputed, programs-of-thought run in the eval sandbox, and a policy for disagreement.

Per solution (:meth:`Verifier.check_solution`), in order:

1. the ``#### <answer>`` line must parse as a number or a small SymPy expression
   (:func:`parse_answer`), else ``malformed``;
2. every ``<<expr=value>>`` annotation is recomputed with SymPy and must match
   (:func:`numbers_match`), else ``bad_step``;
3. a program-of-thought, when present, runs in :mod:`forge_kit.sandbox` (bubblewrap: no network,
   no host files, limits); it must exit 0 and its last printed line must match the answer, else
   ``program_failed`` / ``program_mismatch``.

Per problem (:meth:`Verifier.verify`): the valid solutions are grouped by matching answers. One
group: kept. Several: policy ``drop`` drops the problem (``disagreement``), ``majority`` keeps the
largest group when it holds more than half of the valid solutions (else ``no_majority``). No valid
solution: ``no_valid_solution``. Anything the checks raise drops the problem with
``verifier_error: <type>: <message>``: one bad problem never stops a run.

Tolerance (:func:`numbers_match`): exact rationals compare exactly; a decimal written with ``d``
places matches a value that rounds to it (``0.33`` matches ``1/3``); otherwise relative 1e-6;
``25%`` matches 25 and 0.25.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from tokenize import TokenError
from typing import Literal

import sympy
from sympy.parsing.sympy_parser import parse_expr

from forge_kit import sandbox
from forge_training.synthetic.problems import Problem, Solution, format_number

Policy = Literal["drop", "majority"]
MAX_ANSWER_CHARS = 64
_FINAL = re.compile(r"^####[ \t]*(.*?)[ \t]*$", re.MULTILINE)
_ANNOTATION = re.compile(r"<<([^<>=]*)=([^<>=]*)>>")
_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d*)?|\.\d+)|(sqrt|pi)|(\*\*|[-+*/^()]))")
_SAFE_POWER = re.compile(r"(\*\*|\^)\s*\(?\s*-?\d{1,2}(?![\d.])")
_RELATIVE = 1e-6


@dataclass(frozen=True)
class Number:
    """A parsed answer: its exact SymPy value, the decimal places written (None when not a
    decimal) and whether it was written as a percentage."""

    value: sympy.Expr
    places: int | None = None
    percent: bool = False


def parse_answer(text: str) -> Number | None:
    """A number (``1,234``, ``$5``, ``-2.50``, ``3/4``, ``25%``) or a small expression of numbers
    with ``+ - * / ^ ( ) sqrt pi`` (one power, its exponent at most two digits); None when it is anything
    else, too long, or not a finite real number. Nothing but those tokens reaches SymPy."""
    s = text.strip().rstrip(".").replace(",", "").replace("$", "").strip()
    percent = s.endswith("%")
    s = s.rstrip("%").strip()
    if not s or len(s) > MAX_ANSWER_CHARS:
        return None
    pos = 0
    while pos < len(s):
        m = _TOKEN.match(s, pos)
        if m is None:
            return None
        pos = m.end()
    powers = [op.start() for op in re.finditer(r"\*\*|\^", s)]
    if len(powers) > 1 or (powers and not _SAFE_POWER.match(s, powers[0])):
        return None  # 9**9**9 would not finish
    try:
        value = parse_expr(s.replace("^", "**"), local_dict={"sqrt": sympy.sqrt, "pi": sympy.pi})
    except (SyntaxError, TypeError, ValueError, ZeroDivisionError, TokenError):
        return None
    if not isinstance(value, sympy.Expr) or not value.is_real or not value.is_finite:
        return None
    decimal = re.fullmatch(r"-?\d*\.(\d+)", s)
    return Number(
        sympy.nsimplify(value, rational=True) if decimal else value,
        len(decimal.group(1)) if decimal else None,
        percent,
    )


def _close(a: sympy.Expr, b: sympy.Expr, places: int | None) -> bool:
    if a.is_Rational and b.is_Rational and places is None:
        return bool(a == b)
    x, y = float(a), float(b)
    if places is not None and abs(x - y) <= 0.5 * 10**-places + 1e-12:
        return True
    return math.isclose(x, y, rel_tol=_RELATIVE, abs_tol=1e-12)


def numbers_match(a: Number, b: Number) -> bool:
    """Whether two answers agree under the tolerance rules of the module docstring."""
    places = a.places if b.places is None else b.places if a.places is None else min(a.places, b.places)
    candidates = [(a.value, b.value)]
    if a.percent != b.percent:  # 25% is 25, or 0.25
        pct, other = (a, b) if a.percent else (b, a)
        candidates.append((pct.value / 100, other.value))
    return any(_close(x, y, places) for x, y in candidates)


def final_answer(text: str) -> str | None:
    """The text after the last ``####`` line, or None when there is none."""
    found = _FINAL.findall(text)
    return found[-1] if found else None


SolutionStatus = Literal["ok", "malformed", "bad_step", "program_failed", "program_mismatch"]
ProgramRunner = Callable[[str], sandbox.SandboxResult]


@dataclass(frozen=True)
class SolutionCheck:
    status: SolutionStatus
    answer: Number | None = None
    detail: str = ""


@dataclass(frozen=True)
class Verified:
    """A problem that passed: its ``answer`` and the solutions that agree with it."""

    problem: Problem
    answer: str
    solutions: tuple[Solution, ...]
    checks: tuple[str, ...]


@dataclass(frozen=True)
class Dropped:
    problem: Problem
    reason: str
    checks: tuple[str, ...] = ()


@dataclass
class VerifyReport:
    """Every problem verified: kept, dropped (each with its reason), and counts."""

    kept: list[Verified] = field(default_factory=list)
    dropped: list[Dropped] = field(default_factory=list)
    solution_status: dict[str, int] = field(default_factory=dict)

    def counts(self) -> dict[str, object]:
        reasons: dict[str, int] = {}
        for d in self.dropped:
            key = d.reason.split(":")[0]
            reasons[key] = reasons.get(key, 0) + 1
        return {
            "problems": len(self.kept) + len(self.dropped),
            "kept": len(self.kept),
            "dropped": len(self.dropped),
            "dropped_by_reason": dict(sorted(reasons.items())),
            "solutions_by_status": dict(sorted(self.solution_status.items())),
        }


def sandbox_runner(limits: sandbox.SandboxLimits) -> ProgramRunner:
    """Programs run by :func:`forge_kit.sandbox.run_python` (the eval service's HumanEval sandbox)."""
    return lambda source: sandbox.run_python(source, limits)


class Verifier:
    """Checks solutions and problems (see the module docstring). ``run_program`` defaults to the
    sandbox (checked to be available when the verifier is made, so a machine without one fails
    at once, not problem by problem)."""

    def __init__(
        self,
        policy: Policy = "majority",
        *,
        run_program: ProgramRunner | None = None,
        limits: sandbox.SandboxLimits = sandbox.SandboxLimits(timeout_s=5.0, memory_bytes=256 << 20),
    ) -> None:
        if policy not in ("drop", "majority"):
            raise ValueError(f"policy must be drop or majority, got {policy!r}")
        self.policy = policy
        if run_program is None:
            sandbox.check_available()
            run_program = sandbox_runner(limits)
        self.run_program = run_program

    def check_solution(self, solution: Solution) -> SolutionCheck:
        # 1. The final answer.
        raw = final_answer(solution.text)
        answer = parse_answer(raw) if raw is not None else None
        if answer is None:
            return SolutionCheck("malformed", detail=f"final answer {raw!r}")
        # 2. Calculator annotations.
        for expr, value in _ANNOTATION.findall(solution.text):
            computed, written = parse_answer(expr), parse_answer(value)
            if computed is None or written is None or not numbers_match(computed, written):
                return SolutionCheck("bad_step", answer, f"<<{expr}={value}>>")
        # 3. The program-of-thought.
        if solution.program:
            result = self.run_program(solution.program)
            if not result.passed:
                return SolutionCheck("program_failed", answer, f"{result.status}: {result.output[-200:]}")
            lines = [ln for ln in result.output.splitlines() if ln.strip()]
            printed = parse_answer(lines[-1]) if lines else None
            if printed is None or not numbers_match(printed, answer):
                return SolutionCheck("program_mismatch", answer, f"printed {lines[-1:]!r}")
        return SolutionCheck("ok", answer)

    def verify_problem(self, problem: Problem) -> Verified | Dropped:
        """One problem; raises only what a check raised (see :meth:`verify`)."""
        checks = [self.check_solution(s) for s in problem.solutions]
        statuses = tuple(c.status for c in checks)
        valid = [(s, c.answer) for s, c in zip(problem.solutions, checks, strict=True) if c.status == "ok"]
        groups: list[list[tuple[Solution, Number]]] = []
        for solution, answer in valid:
            assert answer is not None
            for group in groups:
                if numbers_match(group[0][1], answer):
                    group.append((solution, answer))
                    break
            else:
                groups.append([(solution, answer)])
        if not groups:
            return Dropped(problem, "no_valid_solution", statuses)
        groups.sort(key=len, reverse=True)
        if len(groups) > 1:
            if self.policy == "drop":
                return Dropped(problem, f"disagreement: {len(groups)} answers", statuses)
            if 2 * len(groups[0]) <= len(valid):
                return Dropped(problem, f"no_majority: {len(groups[0])} of {len(valid)}", statuses)
        best = groups[0]
        return Verified(problem, canonical(best[0][1]), tuple(s for s, _ in best), statuses)

    def verify(self, problems: Sequence[Problem]) -> VerifyReport:
        """Every problem; one whose checks raise is dropped with the exception as its reason."""
        report = VerifyReport()
        for problem in problems:
            try:
                outcome = self.verify_problem(problem)
            except Exception as exc:  # noqa: BLE001 - a broken verifier drops the problem, never the run
                outcome = Dropped(problem, f"verifier_error: {type(exc).__name__}: {str(exc)[:200]}")
            if isinstance(outcome, Verified):
                report.kept.append(outcome)
            else:
                report.dropped.append(outcome)
            for status in outcome.checks:
                report.solution_status[status] = report.solution_status.get(status, 0) + 1
        return report


def canonical(number: Number) -> str:
    """The answer as a plain string (an integer, an exact decimal, ``p/q``, or SymPy's text)."""
    value = number.value
    if value.is_Rational:
        return format_number(Fraction(int(value.p), int(value.q)))
    return str(value)


def grade(completion: str, answer: str) -> bool:
    """Whether a student's completion ends in a ``####`` answer matching ``answer``."""
    raw = final_answer(completion)
    got = parse_answer(raw) if raw is not None else None
    want = parse_answer(answer)
    return got is not None and want is not None and numbers_match(got, want)
