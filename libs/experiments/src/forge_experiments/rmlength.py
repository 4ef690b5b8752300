"""Reward-model accuracy stratified by which reply is longer, and the gate on it.

A reward model that learned "longer is better" looks fine on data where the preferred reply is
usually the longer one and fails where it is not. Each scored pair falls in one stratum by the
length of its two replies, counted in words (whitespace-separated pieces, so no tokenizer is
needed and every tool counts alike):

- ``preferred_longer``: the chosen reply has more words than the rejected one;
- ``preferred_shorter``: it has fewer;
- ``tie``: both have as many.

Each stratum gets the pairwise accuracy (a score tie counts one half, as everywhere in Forge)
with its 95 % Wilson interval, and :func:`length_gate` refuses a reward model whose
preferred-shorter accuracy does not beat chance significantly: a pure length detector is right
on almost every preferred-longer pair and wrong on almost every preferred-shorter one, whatever
its overall accuracy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from forge_kit.stats import wilson_interval

STRATA = ("preferred_longer", "preferred_shorter", "tie")
LENGTH_UNIT = "words"
#: Default of the gate: the preferred-shorter interval's lower end must lie above this.
MIN_SHORTER_LOW = 0.5
#: The gate refuses to judge a stratum with fewer pairs than this by default: none at all. The
#: Wilson interval already widens as n falls (all of 10 right: lower end 0.72; 7 of 10: 0.40).
MIN_SHORTER_N = 1


def words(text: str) -> int:
    """Length of a reply in words (whitespace-separated pieces)."""
    return len(text.split())


def stratum(chosen: str, rejected: str) -> str:
    """Which of :data:`STRATA` a pair falls in."""
    good, bad = words(chosen), words(rejected)
    return "preferred_longer" if good > bad else "preferred_shorter" if good < bad else "tie"


@dataclass(frozen=True)
class StratumAccuracy:
    """Accuracy of one stratum with its 95 % Wilson interval (NaN bounds when ``n`` is 0)."""

    accuracy: float
    ci95_low: float
    ci95_high: float
    n: int

    @classmethod
    def of(cls, wins: float, n: int) -> StratumAccuracy:
        if n < 0 or not 0 <= wins <= n:
            raise ValueError(f"wins must lie in [0, n], got wins={wins}, n={n}")
        if not n:
            return cls(float("nan"), float("nan"), float("nan"), 0)
        low, high = wilson_interval(wins, n)
        return cls(wins / n, low, high, n)


def stratified_accuracy(
    strata: Sequence[str], chosen_scores: Sequence[float], rejected_scores: Sequence[float]
) -> dict[str, StratumAccuracy]:
    """Per stratum (every one of :data:`STRATA`, empty ones with n = 0): the share of its pairs
    whose chosen reply scores above the rejected one, a tie counting one half."""
    if not len(strata) == len(chosen_scores) == len(rejected_scores):
        raise ValueError("strata, chosen and rejected scores must have the same length")
    wins = dict.fromkeys(STRATA, 0.0)
    counts = dict.fromkeys(STRATA, 0)
    for name, good, bad in zip(strata, chosen_scores, rejected_scores, strict=True):
        if name not in wins:
            raise ValueError(f"unknown stratum {name!r} (known: {', '.join(STRATA)})")
        wins[name] += 1.0 if good > bad else 0.5 if good == bad else 0.0
        counts[name] += 1
    return {name: StratumAccuracy.of(wins[name], counts[name]) for name in STRATA}


def as_summary(by_length: Mapping[str, StratumAccuracy]) -> dict[str, Any]:
    """The ``by_length`` entry of ``forge rm eval``'s summary.json: ``{"unit": "words",
    STRATUM: {"accuracy", "ci95_low", "ci95_high", "n"}, ...}`` (NaN written as null)."""
    out: dict[str, Any] = {"unit": LENGTH_UNIT}
    for name in STRATA:
        figures = asdict(by_length[name])
        out[name] = {k: (None if isinstance(v, float) and v != v else v) for k, v in figures.items()}
    return out


def registry_metrics(summary: Mapping[str, Any]) -> dict[str, float]:
    """The ``by_length`` figures of a ``forge rm eval`` summary as reward-model registry metrics:
    ``heldout_{stratum}_{accuracy,ci95_low,ci95_high,n}`` (an empty stratum gives only its n;
    no ``by_length``: nothing)."""
    by_length = summary.get("by_length")
    if not isinstance(by_length, Mapping):
        return {}
    out: dict[str, float] = {}
    for name in STRATA:
        figures = by_length.get(name)
        if not isinstance(figures, Mapping):
            continue
        for key in ("accuracy", "ci95_low", "ci95_high", "n"):
            value = figures.get(key)
            if isinstance(value, int | float) and value == value:
                out[f"heldout_{name}_{key}"] = float(value)
    return out


def length_gate(
    summary: Mapping[str, Any],
    *,
    min_shorter_low: float = MIN_SHORTER_LOW,
    min_shorter_n: int = MIN_SHORTER_N,
) -> str:
    """Why a reward model may not be used on length grounds (empty when it may): in the
    ``by_length`` entry of a ``forge rm eval`` summary, the preferred-shorter stratum needs at
    least ``min_shorter_n`` pairs and the lower end of its 95 % interval above
    ``min_shorter_low``."""
    by_length = summary.get("by_length")
    if not isinstance(by_length, Mapping):
        return "rm eval summary has no 'by_length' (accuracy by which reply is longer)"
    shorter = by_length.get("preferred_shorter")
    if not isinstance(shorter, Mapping):
        return "rm eval summary's by_length has no 'preferred_shorter'"
    try:
        n = int(shorter["n"])
        accuracy = float(shorter["accuracy"]) if n else float("nan")
        low = float(shorter["ci95_low"]) if n else float("nan")
        high = float(shorter["ci95_high"]) if n else float("nan")
    except (KeyError, TypeError, ValueError) as exc:
        return f"rm eval summary's by_length.preferred_shorter is malformed ({exc!r})"
    if n < min_shorter_n:
        return (
            f"only {n} held-out pairs prefer the shorter reply (at least {min_shorter_n} are needed "
            "to tell a quality judge from a length detector)"
        )
    if low > min_shorter_low:
        return ""
    longer = by_length.get("preferred_longer")
    seen = (
        f"; {float(longer['accuracy']):.3f} where it is the longer one (n={int(longer['n'])})"
        if isinstance(longer, Mapping) and longer.get("n")
        else ""
    )
    return (
        f"judges length, not quality: accuracy {accuracy:.3f} [{low:.3f}, {high:.3f}] on the n={n} "
        f"held-out pairs whose preferred reply is the shorter one{seen}; the 95% interval's lower "
        f"end must exceed {min_shorter_low:.2f}"
    )
