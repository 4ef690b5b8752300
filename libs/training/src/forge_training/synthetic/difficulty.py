"""Difficulty filtering: a student's pass rate on each problem, and the band of problems it solves
some but not all of the time (STaR / ReST-EM practice: keep pass rates in [0.2, 0.8]).

The student answers through the :class:`Student` protocol: ``sample(prompts, n)`` returns ``n``
completions per prompt. :class:`~forge_training.synthetic.student.HFStudent` is the local
implementation on a Forge export or any Hugging Face causal LM directory (torch, in a module of its
own: this one imports no torch); the synthetic-data workflow adds one that samples through the
platform. A completion passes when its ``####`` answer matches the verified answer
(:func:`forge_training.synthetic.verify.grade`).

:func:`band_filter` keeps problems with ``lo <= pass rate <= hi`` and reports the histogram of
pass rates; an empty band raises :class:`EmptyBandError` carrying that histogram.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from forge_training.pairs import render
from forge_training.synthetic.verify import Verified, grade

HISTOGRAM_BINS = 10


class Student(Protocol):
    """The model being taught. Called by :func:`pass_rates` (and the workflow's difficulty
    activity) with a batch of prompts; returns ``n`` completions per prompt, in prompt order."""

    @property
    def name(self) -> str:
        """What the lineage records as the student."""

    def sample(
        self, prompts: Sequence[str], n: int, *, temperature: float, max_new_tokens: int, seed: int
    ) -> list[list[str]]: ...


def prompt_of(question: str) -> str:
    """The chat-template prompt the ``sft`` task trains on: ``User: …\\nAssistant:``."""
    return render([{"role": "user", "content": question}], add_generation_prompt=True)


def pass_rates(
    student: Student,
    items: Sequence[Verified],
    n: int = 8,
    *,
    temperature: float = 1.0,
    max_new_tokens: int = 96,
    seed: int = 0,
    chunk: int = 64,
) -> list[float]:
    """Per problem: the share of ``n`` sampled completions whose answer matches the verified one."""
    rates: list[float] = []
    for start in range(0, len(items), chunk):
        part = items[start : start + chunk]
        samples = student.sample(
            [prompt_of(v.problem.question) for v in part],
            n,
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            seed=seed + start,
        )
        if len(samples) != len(part) or any(len(s) != n for s in samples):
            raise ValueError(
                f"student {student.name}: expected {n} completions for each of {len(part)} prompts"
            )
        rates += [sum(grade(c, v.answer) for c in s) / n for v, s in zip(part, samples, strict=True)]
    return rates


def histogram(rates: Sequence[float], bins: int = HISTOGRAM_BINS) -> dict[str, int]:
    """Counts of pass rates in ``bins`` equal bins over [0, 1] (the last one closed), keyed
    ``"0.0-0.1"`` ..."""
    counts = [0] * bins
    for r in rates:
        counts[min(bins - 1, max(0, int(r * bins)))] += 1
    return {f"{i / bins:.1f}-{(i + 1) / bins:.1f}": c for i, c in enumerate(counts)}


class EmptyBandError(ValueError):
    """No problem's pass rate lies in the band; ``histogram`` says where they fell."""

    def __init__(self, lo: float, hi: float, rates: Sequence[float]) -> None:
        self.histogram = histogram(rates)
        super().__init__(
            f"no problem has a pass rate in [{lo}, {hi}] ({len(rates)} problems); "
            f"pass-rate histogram: {self.histogram}"
        )


@dataclass(frozen=True)
class BandResult:
    kept: list[Verified]
    rates: list[float]
    lo: float
    hi: float
    histogram: dict[str, int]
    below: int
    above: int

    def counts(self) -> dict[str, object]:
        return {
            "in": len(self.kept) + self.below + self.above,
            "kept": len(self.kept),
            "below_band": self.below,
            "above_band": self.above,
            "band": [self.lo, self.hi],
            "histogram": self.histogram,
        }


def check_band(lo: float, hi: float) -> None:
    if not 0.0 <= lo <= hi <= 1.0:
        raise ValueError(f"the band must satisfy 0 <= lo <= hi <= 1, got [{lo}, {hi}]")


def band_filter(
    items: Sequence[Verified], rates: Sequence[float], lo: float = 0.2, hi: float = 0.8
) -> BandResult:
    """The problems with ``lo <= rate <= hi`` (in order) and their rates; :class:`EmptyBandError`
    when there are none."""
    check_band(lo, hi)
    if len(items) != len(rates):
        raise ValueError(f"{len(items)} problems but {len(rates)} pass rates")
    kept = [(v, r) for v, r in zip(items, rates, strict=True) if lo <= r <= hi]
    if not kept:
        raise EmptyBandError(lo, hi, rates)
    return BandResult(
        [v for v, _ in kept],
        [r for _, r in kept],
        lo,
        hi,
        histogram(rates),
        sum(r < lo for r in rates),
        sum(r > hi for r in rates),
    )
