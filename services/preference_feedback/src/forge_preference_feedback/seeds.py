"""Comparison seeds from Anthropic HH-RLHF pairs (``chosen`` / ``rejected`` full transcripts).

The prompt is the transcript both share up to the last ``"\\n\\nAssistant:"``; the two responses
are what follows it. Pairs whose transcripts are identical, whose responses are identical or
empty, or whose prefixes differ (the two sides are not answers to the same prompt) are skipped and
counted by reason.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ASSISTANT = "\n\nAssistant:"


class PairRejected(ValueError):
    """A source pair that cannot become a comparison; ``reason`` is a short code."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class PreferencePair:
    """One usable pair: the prompt, and the preferred and the other response."""

    source: str
    key: str
    prompt: str
    chosen: str
    rejected: str


@dataclass(frozen=True)
class Arranged:
    """A pair in the order raters see it; ``gold`` is the side the source preferred."""

    response_a: str
    response_b: str
    gold: str


@dataclass
class ReadStats:
    """What a read of the source found."""

    usable: int = 0
    skipped: Counter[str] = field(default_factory=Counter)


def split_pair(chosen: str, rejected: str) -> tuple[str, str, str]:
    """``(prompt, chosen response, rejected response)``; raises :class:`PairRejected`."""
    if chosen == rejected:
        raise PairRejected("identical")
    cut_c, cut_r = chosen.rfind(ASSISTANT), rejected.rfind(ASSISTANT)
    if cut_c < 0 or cut_r < 0:
        raise PairRejected("no_assistant_turn")
    if chosen[:cut_c] != rejected[:cut_r]:
        raise PairRejected("mismatched_prefix")
    good, bad = chosen[cut_c + len(ASSISTANT) :].strip(), rejected[cut_r + len(ASSISTANT) :].strip()
    if not good or not bad:
        raise PairRejected("empty_response")
    if good == bad:
        raise PairRejected("identical")
    return chosen[:cut_c].strip(), good, bad


def arrange(pair: PreferencePair, rng_seed: int) -> Arranged:
    """Put the chosen response at A or B by a coin seeded per pair, so the order does not depend
    on which other pairs are loaded or in what order."""
    chosen_first = random.Random(f"{rng_seed}:{pair.key}").random() < 0.5
    if chosen_first:
        return Arranged(pair.chosen, pair.rejected, "A")
    return Arranged(pair.rejected, pair.chosen, "B")


def stable_id(prefix: str, *parts: str) -> str:
    return f"{prefix}-{hashlib.sha256(':'.join(parts).encode()).hexdigest()[:16]}"


def _files(root: Path) -> list[Path]:
    patterns = ("*.jsonl.gz", "*.jsonl", "*/*.jsonl.gz", "*/*.jsonl")
    return sorted({p for pattern in patterns for p in root.glob(pattern) if p.is_file()})


def _lines(path: Path) -> Iterator[str]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as handle:  # type: ignore[operator]
        yield from handle


def read_hh_rlhf(root: Path, stats: ReadStats | None = None) -> Iterator[PreferencePair]:
    """Usable pairs of every HH-RLHF file under ``root``, taking one pair from each file in turn
    so that a prefix of the stream mixes the subsets (helpful, harmless)."""
    if not root.is_dir():
        raise FileNotFoundError(f"HH-RLHF folder {root} does not exist")
    stats = stats if stats is not None else ReadStats()
    streams = []
    for path in _files(root):
        source = f"hh-rlhf/{path.parent.name}" if path.parent != root else f"hh-rlhf/{root.name}"
        streams.append((source, path, enumerate(_lines(path))))
    while streams:
        for entry in list(streams):
            source, path, lines = entry
            pair = _next_pair(source, path, lines, stats)
            if pair is None:
                streams.remove(entry)
            else:
                yield pair


def _next_pair(
    source: str, path: Path, lines: Iterator[tuple[int, str]], stats: ReadStats
) -> PreferencePair | None:
    for number, line in lines:
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt, chosen, rejected = split_pair(str(row["chosen"]), str(row["rejected"]))
        except PairRejected as exc:
            stats.skipped[exc.reason] += 1
            continue
        except (ValueError, KeyError, TypeError):
            stats.skipped["unreadable"] += 1
            continue
        stats.usable += 1
        return PreferencePair(source, f"{source}/{path.name}:{number}", prompt, chosen, rejected)
    return None
