"""VLM evaluation metrics as pure functions (no torch), so the eval service's tasks call the same
code: VQA exact match, caption BLEU-4, and the summaries the benchmark reports.

- **VQA accuracy**: exact match after :func:`normalise` (lower case, punctuation and the article
  "a"/"an"/"the" removed, spaces collapsed); the interval is Wilson's 95 % one.
- **Caption metric: BLEU-4** (Papineni et al. 2002): corpus-level, uniform weights over 1-4-gram
  clipped precisions, brevity penalty against the closest reference length, whitespace tokens of
  the normalised text; 0 when some n-gram order has no match. :func:`sentence_bleu4` is the
  per-caption version with Lin & Och's add-one smoothing for orders 2-4 (for paired comparisons).
- **Text-only control**: the same questions asked without the image, scored by
  :func:`vqa_accuracy`; a model that reads the image should beat it by a wide margin.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence

from forge_kit.stats import wilson_interval

_PUNCT = re.compile(r"[^\w\s]")
_ARTICLES = {"a", "an", "the"}


def normalise(text: str) -> str:
    words = _PUNCT.sub(" ", text.lower()).split()
    return " ".join(w for w in words if w not in _ARTICLES)


def exact_match(prediction: str, reference: str) -> float:
    """1.0 when the normalised texts are equal, else 0.0."""
    return 1.0 if normalise(prediction) == normalise(reference) else 0.0


def exact_matches(predictions: Sequence[str], references: Sequence[str]) -> list[float]:
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
    return [exact_match(p, r) for p, r in zip(predictions, references, strict=True)]


def vqa_accuracy(predictions: Sequence[str], references: Sequence[str]) -> tuple[float, tuple[float, float]]:
    """Exact-match accuracy and its 95 % Wilson interval."""
    scores = exact_matches(predictions, references)
    if not scores:
        return math.nan, (0.0, 1.0)
    hits = sum(scores)
    return hits / len(scores), wilson_interval(hits, len(scores))


def accuracy_by(groups: Sequence[str], scores: Sequence[float]) -> dict[str, float]:
    """Mean score per group label (e.g. question type)."""
    totals: dict[str, list[float]] = {}
    for g, s in zip(groups, scores, strict=True):
        totals.setdefault(g, []).append(s)
    return {g: sum(v) / len(v) for g, v in sorted(totals.items())}


def _ngrams(words: Sequence[str], n: int) -> Counter[tuple[str, ...]]:
    return Counter(tuple(words[i : i + n]) for i in range(len(words) - n + 1))


def _counts(candidate: str, reference: str) -> tuple[list[int], list[int], int, int]:
    cand, ref = normalise(candidate).split(), normalise(reference).split()
    matches, totals = [], []
    for n in range(1, 5):
        c, r = _ngrams(cand, n), _ngrams(ref, n)
        matches.append(sum(min(k, r[g]) for g, k in c.items()))
        totals.append(max(len(cand) - n + 1, 0))
    return matches, totals, len(cand), len(ref)


def _bleu(matches: Sequence[float], totals: Sequence[float], cand_len: int, ref_len: int) -> float:
    if cand_len == 0 or any(m <= 0 for m in matches) or any(t <= 0 for t in totals):
        return 0.0
    log_p = sum(math.log(m / t) for m, t in zip(matches, totals, strict=True)) / 4
    brevity = 1.0 if cand_len > ref_len else math.exp(1 - ref_len / cand_len)
    return brevity * math.exp(log_p)


def bleu4(candidates: Sequence[str], references: Sequence[str]) -> float:
    """Corpus BLEU-4 of ``candidates`` against one reference each, in [0, 1]."""
    if len(candidates) != len(references):
        raise ValueError(f"{len(candidates)} candidates for {len(references)} references")
    matches, totals = [0] * 4, [0] * 4
    cand_len = ref_len = 0
    for c, r in zip(candidates, references, strict=True):
        m, t, cl, rl = _counts(c, r)
        matches = [a + b for a, b in zip(matches, m, strict=True)]
        totals = [a + b for a, b in zip(totals, t, strict=True)]
        cand_len, ref_len = cand_len + cl, ref_len + rl
    return _bleu(matches, totals, cand_len, ref_len)


def sentence_bleu4(candidate: str, reference: str) -> float:
    """BLEU-4 of one caption, add-one smoothing on orders 2-4 (Lin & Och 2004)."""
    m, t, cl, rl = _counts(candidate, reference)
    if cl == 0 or m[0] == 0:
        return 0.0
    smoothed_m = [m[0]] + [x + 1 for x in m[1:]]
    smoothed_t = [t[0]] + [x + 1 for x in t[1:]]
    return _bleu(smoothed_m, smoothed_t, cl, rl)
