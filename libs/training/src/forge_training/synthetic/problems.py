"""Problems, worked solutions, seed templates and the programmatic teacher.

A :class:`Problem` is a question from one template with ``k`` worked :class:`Solution` s. A worked
solution is GSM8K-style: one line per step with calculator annotations ``<<expr=value>>`` (what
the verifier recomputes) and a final line ``#### <answer>``; some solutions also carry a
program-of-thought (a Python snippet printing the answer, run in the sandbox by the verifier).

Templates are generators ``(rng, level) -> Draft`` with an id, a topic and a split: the TRAIN
templates write the data set, the HELD-OUT templates (the same skills, worded differently) only
the evaluation problems. A TRAIN template words each problem with one of its many paraphrased
TRAIN wordings (:mod:`~forge_training.synthetic.wordings`); :data:`DEV_TEMPLATES` are the same
templates with their DEV wordings (never trained on, for selecting settings). ``level`` (1-3) sets the size of the numbers and so the difficulty.

:class:`ProgrammaticTeacher` is this machine's teacher: a program, not a model. It writes each
problem's ``k`` solutions and, with probability ``error_rate`` per solution, plants one error
(``arithmetic``: a step's result is off and the rest follows from it; ``final``: the steps are
right, the ``####`` answer is not; ``malformed``: the ``####`` line is unreadable), so that
verification has something to catch. Which error it planted is recorded in ``Solution.planted``
for measuring the verifier; the verifier never reads it. Output is a pure function of the seed.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import Any, Literal, Protocol

from forge_training.synthetic import wordings

Split = Literal["train", "held_out"]
ERROR_KINDS = ("arithmetic", "final", "malformed")
_ANNOTATION = re.compile(r"<<[^<>]*>>")
MAX_TEXT_CHARS = 4000
"""A question or solution longer than this is refused when read back (hostile input)."""


@dataclass(frozen=True)
class Solution:
    """One worked solution: ``text`` ends in ``#### <answer>``; ``program`` (optional) prints
    the answer; ``planted`` is the error the programmatic teacher planted (``""``: none, or an
    LLM teacher's solution, where nothing is known)."""

    text: str
    program: str = ""
    planted: str = ""

    def plain(self) -> str:
        """The text without calculator annotations (what a student is trained on)."""
        return _ANNOTATION.sub("", self.text)


@dataclass(frozen=True)
class Problem:
    """A question and its worked solutions. ``reference`` is the teacher's own answer where it
    knows it (the programmatic teacher does; an LLM teacher leaves it empty): the verifier does
    not use it, the benchmark measures the verifier against it."""

    id: str
    template: str
    topic: str
    split: Split
    level: int
    question: str
    solutions: tuple[Solution, ...]
    reference: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> Problem:
        """The problem of one JSON object; a missing field, a wrong type or an over-long text
        raises ValueError naming it."""
        try:
            solutions = tuple(
                Solution(str(s["text"]), str(s.get("program", "")), str(s.get("planted", "")))
                for s in row["solutions"]
            )
            problem = cls(
                id=str(row["id"]),
                template=str(row["template"]),
                topic=str(row["topic"]),
                split=row.get("split", "train"),
                level=int(row.get("level", 0)),
                question=str(row["question"]),
                solutions=solutions,
                reference=str(row.get("reference", "")),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a problem: missing or wrong field {exc}") from exc
        if problem.split not in ("train", "held_out"):
            raise ValueError(f"problem {problem.id}: split must be train or held_out, got {problem.split!r}")
        texts = [problem.question, *(s.text for s in solutions), *(s.program for s in solutions)]
        if any(len(t) > MAX_TEXT_CHARS for t in texts):
            raise ValueError(f"problem {problem.id}: a text is longer than {MAX_TEXT_CHARS} characters")
        return problem


def dumps(problems: Iterable[Problem]) -> str:
    """Problems as JSON lines."""
    return "".join(json.dumps(p.to_json(), sort_keys=True) + "\n" for p in problems)


def loads(text: str) -> list[Problem]:
    """Problems from JSON lines (:func:`dumps`)."""
    return [Problem.from_json(json.loads(line)) for line in text.splitlines() if line.strip()]


def format_number(value: Fraction) -> str:
    """An integer as is, a decimal with at most 4 places when exact, else ``p/q``."""
    if value.denominator == 1:
        return str(value.numerator)
    for places in range(1, 5):
        scaled = value * 10**places
        if scaled.denominator == 1:
            return f"{float(value):.{places}f}"
    return f"{value.numerator}/{value.denominator}"


# --- templates ------------------------------------------------------------------------------

Step = Callable[[list[Fraction]], tuple[str, str, Fraction]]
"""Given the values of the steps before it: (phrase, expression, value)."""


@dataclass(frozen=True)
class Draft:
    """A template's question and the steps that solve it; the last step's value is the answer."""

    question: str
    steps: tuple[Step, ...]


@dataclass(frozen=True)
class Template:
    """A generator of one kind of problem. ``description`` is what an LLM teacher is asked for."""

    id: str
    topic: str
    split: Split
    description: str
    make: Callable[[random.Random, int], Draft] = field(repr=False)


def _n(v: Fraction) -> str:
    return format_number(v)


def _mag(level: int) -> int:
    return {1: 5, 2: 15, 3: 60}.get(level, 5)


def _add_sub(r: random.Random, level: int, pool: str = "train") -> Draft:
    m = _mag(level)
    a, b = r.randint(2, m), r.randint(2, m)
    c = r.randint(1, a + b - 1)
    return Draft(
        wordings.question("add_sub", pool, r, a=a, b=b, c=c),
        (
            lambda v: ("After getting more", f"{a}+{b}", Fraction(a + b)),
            lambda v: ("After giving away", f"{_n(v[0])}-{c}", v[0] - c),
        ),
    )


def _percent_off(r: random.Random, level: int, pool: str = "train") -> Draft:
    m = _mag(level)
    pct = r.choice((10, 20, 25, 50) if level == 1 else (5, 10, 15, 20, 25, 30, 40, 50, 75))
    price = 4 * r.randint(1, m) * (5 if pct in (5, 15) else 1)
    return Draft(
        wordings.question("percent_off", pool, r, price=price, pct=pct),
        (
            lambda v: ("The discount is", f"{price}*{pct}/100", Fraction(price * pct, 100)),
            lambda v: ("The sale price is", f"{price}-{_n(v[0])}", price - v[0]),
        ),
    )


def _ratio_share(r: random.Random, level: int, pool: str = "train") -> Draft:
    x, y = r.randint(1, 3 + level), r.randint(1, 3 + level)
    unit = r.randint(2, _mag(level))
    total = unit * (x + y)
    return Draft(
        wordings.question("ratio_share", pool, r, total=total, x=x, y=y),
        (
            lambda v: ("The parts are", f"{x}+{y}", Fraction(x + y)),
            lambda v: ("One part is", f"{total}/{_n(v[0])}", total / v[0]),
            lambda v: ("The first part is", f"{_n(v[1])}*{x}", v[1] * x),
        ),
    )


def _linear(r: random.Random, level: int, pool: str = "train") -> Draft:
    m = _mag(level)
    a, x, b = r.randint(2, 2 + 3 * level), r.randint(1, m), r.randint(1, m)
    c = a * x + b
    return Draft(
        wordings.question("linear_eq", pool, r, a=a, b=b, c=c),
        (
            lambda v: ("Subtract", f"{c}-{b}", Fraction(c - b)),
            lambda v: ("Divide", f"{_n(v[0])}/{a}", v[0] / a),
        ),
    )


def _unit_price(r: random.Random, level: int, pool: str = "train") -> Draft:
    n, unit, k = r.randint(2, 4 + level), r.randint(1, _mag(level)), r.randint(2, 3 + 3 * level)
    return Draft(
        wordings.question("unit_price", pool, r, n=n, total=n * unit, k=k),
        (
            lambda v: ("One costs", f"{n * unit}/{n}", Fraction(unit)),
            lambda v: (f"{k} cost", f"{_n(v[0])}*{k}", v[0] * k),
        ),
    )


def _fraction_rest(r: random.Random, level: int, pool: str = "train") -> Draft:
    q = r.choice((2, 3, 4, 5) if level == 1 else (3, 4, 5, 6, 8))
    p = r.randint(1, q - 1)
    n = q * r.randint(1, _mag(level))
    return Draft(
        wordings.question("fraction_rest", pool, r, n=n, p=p, q=q),
        (
            lambda v: ("Walkers", f"{n}*{p}/{q}", Fraction(n * p, q)),
            lambda v: ("Not walking", f"{n}-{_n(v[0])}", n - v[0]),
        ),
    )


def _fraction_sum(r: random.Random, level: int, pool: str = "train") -> Draft:
    a, b = r.randint(1, 2 + 2 * level), r.randint(2, 3 + 2 * level)
    c, d = r.randint(1, 2 + 2 * level), r.randint(2, 3 + 2 * level)
    return Draft(
        wordings.question("fraction_sum", pool, r, a=a, b=b, c=c, d=d),
        (lambda v: ("The sum is", f"{a}/{b}+{c}/{d}", Fraction(a, b) + Fraction(c, d)),),
    )


def _shop(r: random.Random, level: int, pool: str = "train") -> Draft:
    m = _mag(level)
    packs, per, price = r.randint(2, 3 + level), r.randint(2, 6), r.randint(1, m)
    cost = packs * price
    paid = cost + r.randint(0, m)
    return Draft(
        wordings.question("shop_change", pool, r, per=per, price=price, packs=packs, paid=paid),
        (
            lambda v: ("The packs cost", f"{packs}*{price}", Fraction(cost)),
            lambda v: ("The change is", f"{paid}-{_n(v[0])}", paid - v[0]),
        ),
    )


# held-out: the same skills and steps, worded differently (other frames, names and nouns; the
# numbers come in the same order), so a template's wording is new to a student trained on TRAIN


def _bus(r: random.Random, level: int) -> Draft:
    m = _mag(level)
    a, b = r.randint(2, m), r.randint(2, m)
    c = r.randint(1, a + b - 1)
    return Draft(
        f"A bus carries {a} people. At a stop {b} people board and later {c} leave. "
        "How many people are on the bus at the end?",
        (
            lambda v: ("After boarding", f"{a}+{b}", Fraction(a + b)),
            lambda v: ("After leaving", f"{_n(v[0])}-{c}", v[0] - c),
        ),
    )


def _lamp_sale(r: random.Random, level: int) -> Draft:
    m = _mag(level)
    pct = r.choice((10, 20, 25, 50) if level == 1 else (5, 10, 15, 20, 25, 30, 40, 50, 75))
    price = 4 * r.randint(1, m) * (5 if pct in (5, 15) else 1)
    return Draft(
        f"A lamp is priced at ${price}. The shop takes {pct}% off the price. How many dollars does the lamp cost now?",
        (
            lambda v: ("Taken off", f"{price}*{pct}/100", Fraction(price * pct, 100)),
            lambda v: ("The lamp costs", f"{price}-{_n(v[0])}", price - v[0]),
        ),
    )


def _paint_ratio(r: random.Random, level: int) -> Draft:
    x, y = r.randint(1, 3 + level), r.randint(1, 3 + level)
    unit = r.randint(2, _mag(level))
    total = unit * (x + y)
    return Draft(
        f"A painter pours {total} litres into blue and white tins in the ratio {x}:{y}. "
        "How many litres go into blue tins?",
        (
            lambda v: ("The parts are", f"{x}+{y}", Fraction(x + y)),
            lambda v: ("One part is", f"{total}/{_n(v[0])}", total / v[0]),
            lambda v: ("Blue gets", f"{_n(v[1])}*{x}", v[1] * x),
        ),
    )


def _think_number(r: random.Random, level: int) -> Draft:
    m = _mag(level)
    a, x, b = r.randint(2, 2 + 3 * level), r.randint(1, m), r.randint(1, m)
    c = a * x + b
    return Draft(
        f"I pick a number, multiply it by {a} and add {b}. The result is {c}. What number did I pick?",
        (
            lambda v: ("Take away", f"{c}-{b}", Fraction(c - b)),
            lambda v: ("Divide", f"{_n(v[0])}/{a}", v[0] / a),
        ),
    )


def _machine_rate(r: random.Random, level: int) -> Draft:
    h, per, k = r.randint(2, 4 + level), r.randint(1, _mag(level)), r.randint(2, 3 + 3 * level)
    return Draft(
        f"In {h} hours a machine makes {h * per} toys. How many toys does it make in {k} hours?",
        (
            lambda v: ("Per hour", f"{h * per}/{h}", Fraction(per)),
            lambda v: (f"In {k} hours", f"{_n(v[0])}*{k}", v[0] * k),
        ),
    )


def _farm_rest(r: random.Random, level: int) -> Draft:
    q = r.choice((2, 3, 4, 5) if level == 1 else (3, 4, 5, 6, 8))
    p = r.randint(1, q - 1)
    n = q * r.randint(1, _mag(level))
    return Draft(
        f"A farm has {n} animals and {p}/{q} of them are sheep. How many animals are not sheep?",
        (
            lambda v: ("Sheep", f"{n}*{p}/{q}", Fraction(n * p, q)),
            lambda v: ("Not sheep", f"{n}-{_n(v[0])}", n - v[0]),
        ),
    )


TEMPLATES: dict[str, Template] = {
    t.id: t
    for t in (
        Template("add_sub", "multi-step arithmetic", "train", "gain then loss of items", _add_sub),
        Template("percent_off", "percentages", "train", "sale price after a discount", _percent_off),
        Template("ratio_share", "ratios", "train", "sharing a total in a ratio", _ratio_share),
        Template("linear_eq", "linear equations", "train", "solve ax + b = c", _linear),
        Template("unit_price", "unit rates", "train", "price of k items from the price of n", _unit_price),
        Template("fraction_rest", "fractions", "train", "the part not in a fraction of a group", _fraction_rest),
        Template("fraction_sum", "fractions", "train", "sum of two fractions", _fraction_sum),
        Template("shop_change", "multi-step arithmetic", "train", "change after buying packs", _shop),
        Template("bus_stop", "multi-step arithmetic", "held_out", "passengers on then off", _bus),
        Template("lamp_sale", "percentages", "held_out", "price after a percentage off", _lamp_sale),
        Template("paint_ratio", "ratios", "held_out", "a part of a total split in a ratio", _paint_ratio),
        Template("think_number", "linear equations", "held_out", "a number from ax + b = c", _think_number),
        Template("machine_rate", "unit rates", "held_out", "output in k hours from a rate", _machine_rate),
        Template("farm_rest", "fractions", "held_out", "the part not in a fraction of a group", _farm_rest),
    )
}  # fmt: skip
TRAIN_TEMPLATES = tuple(t for t in TEMPLATES.values() if t.split == "train")
_WORDED = {
    "add_sub": _add_sub, "percent_off": _percent_off, "ratio_share": _ratio_share, "linear_eq": _linear,
    "unit_price": _unit_price, "fraction_rest": _fraction_rest, "fraction_sum": _fraction_sum,
    "shop_change": _shop,
}  # fmt: skip
DEV_TEMPLATES = tuple(
    dataclasses.replace(t, id=f"{t.id}_dev", make=functools.partial(_WORDED[t.id], pool="dev"))
    for t in TRAIN_TEMPLATES
)
"""The TRAIN templates with their DEV wordings (:mod:`~forge_training.synthetic.wordings`): problems
of the same skills worded as nothing trained on is, for selecting settings; not in ``TEMPLATES``."""
HELD_OUT_TEMPLATES = tuple(t for t in TEMPLATES.values() if t.split == "held_out")


def templates(ids: Sequence[str]) -> list[Template]:
    """The named templates; an unknown id raises ValueError listing the known ones."""
    unknown = [i for i in ids if i not in TEMPLATES]
    if unknown:
        raise ValueError(f"unknown templates {unknown} (known: {', '.join(TEMPLATES)})")
    return [TEMPLATES[i] for i in ids]


# --- the teacher ----------------------------------------------------------------------------


class TeacherError(Exception):
    """The teacher's output could not be read as a problem (malformed, refused, timed out)."""


class Teacher(Protocol):
    """Writes one problem of a template with ``k`` solutions. Called by :func:`generate` (and by
    the synthetic-data workflow's generate activity) once per problem; ``index`` makes the call
    deterministic where the teacher can be. Raises :class:`TeacherError` for unusable output."""

    @property
    def name(self) -> str:
        """What the lineage records as the teacher."""

    def write(self, template: Template, index: int, k: int) -> Problem: ...


@dataclass(frozen=True)
class ProgrammaticTeacher:
    """The programmatic teacher (see the module docstring); ``pot_rate``: the share of solutions
    that carry a program-of-thought; ``phrases``: each step line opens with its words
    (``Walkers: 20*3/4 = <<20*3/4=15>>15.``) or, by default, is the calculation alone
    (``20*3/4 = <<20*3/4=15>>15``: short enough for a tiny student)."""

    seed: int = 0
    error_rate: float = 0.2
    error_kinds: tuple[str, ...] = ERROR_KINDS
    pot_rate: float = 0.25
    levels: tuple[int, ...] = (1, 2, 3)
    phrases: bool = False
    name: str = "programmatic-v1"

    def __post_init__(self) -> None:
        if not 0.0 <= self.error_rate <= 1.0 or not 0.0 <= self.pot_rate <= 1.0:
            raise ValueError("error_rate and pot_rate must be in [0, 1]")
        if not self.error_kinds or any(k not in ERROR_KINDS for k in self.error_kinds):
            raise ValueError(f"error_kinds must be some of {ERROR_KINDS}, got {self.error_kinds}")
        if not self.levels or any(level not in (1, 2, 3) for level in self.levels):
            raise ValueError(f"levels must be some of 1, 2, 3, got {self.levels}")

    def write(self, template: Template, index: int, k: int) -> Problem:
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        r = random.Random(f"{self.seed}:{template.id}:{index}")
        level = r.choice(self.levels)
        draft = template.make(r, level)
        truth = _run_steps(draft.steps, None)
        solutions = tuple(self._solution(draft, truth, r) for _ in range(k))
        return Problem(
            id=f"{template.id}-{self.seed}-{index}",
            template=template.id,
            topic=template.topic,
            split=template.split,
            level=level,
            question=draft.question,
            solutions=solutions,
            reference=format_number(truth[-1][2]),
        )

    def _solution(self, draft: Draft, truth: list[tuple[str, str, Fraction]], r: random.Random) -> Solution:
        planted = r.choice(self.error_kinds) if r.random() < self.error_rate else ""
        steps = truth
        if planted == "arithmetic":
            steps = _run_steps(draft.steps, (r.randrange(len(draft.steps)), _slip(r)))
        lines = [
            f"{phrase + ': ' if self.phrases else ''}{expr} = <<{expr}={format_number(v)}>>{format_number(v)}"
            + ("." if self.phrases else "")
            for phrase, expr, v in steps
        ]
        answer = format_number(steps[-1][2])
        if planted == "final":
            answer = format_number(steps[-1][2] + _slip(r))
        elif planted == "malformed":
            answer = r.choice(("", "about " + answer, f"{answer} or so", "unknown", answer + "??"))
        text = "\n".join([*lines, f"#### {answer}"])
        program = ""
        if r.random() < self.pot_rate:
            body = [f"s{i} = {expr}" for i, (_, expr, _) in enumerate(truth)]
            program = "\n".join([*body, f"print(s{len(truth) - 1})"]) + "\n"
        return Solution(text, program, planted)


def _slip(r: random.Random) -> int:
    return r.choice((-1, 1)) * r.randint(1, 3)


def _run_steps(steps: Sequence[Step], slip: tuple[int, int] | None) -> list[tuple[str, str, Fraction]]:
    """Each step's (phrase, expression, value) given the earlier values; with ``slip`` (i, d) step
    i's value is off by d and the later steps compute from the wrong value."""
    values: list[Fraction] = []
    out = []
    for i, step in enumerate(steps):
        phrase, expr, value = step(values)
        if slip is not None and slip[0] == i:
            value = (
                value + slip[1] if value + slip[1] != 0 else value - slip[1]
            )  # never 0: a later step may divide
        values.append(value)
        out.append((phrase, expr, value))
    return out


@dataclass
class GenerationReport:
    """What :func:`generate` got: problems, and the calls that failed (counted, with reasons)."""

    problems: list[Problem]
    failures: dict[str, int] = field(default_factory=dict)


def generate(
    teacher: Teacher, chosen: Sequence[Template], count: int, k: int, *, retries: int = 2, start: int = 0
) -> GenerationReport:
    """``count`` problems from ``chosen`` templates in turn, ``k`` solutions each. A call that raises
    :class:`TeacherError` is retried ``retries`` times (with the same index) and then skipped;
    every failure is counted by its reason."""
    if not chosen:
        raise ValueError("no templates to generate from")
    report = GenerationReport([])
    for index in range(start, start + count):
        template = chosen[index % len(chosen)]
        for _attempt in range(retries + 1):
            try:
                report.problems.append(teacher.write(template, index, k))
                break
            except TeacherError as exc:
                reason = str(exc).split(":")[0][:80] or type(exc).__name__
                report.failures[reason] = report.failures.get(reason, 0) + 1
    return report
