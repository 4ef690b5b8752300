"""Rater quality: agreement statistics, Dawid–Skene consensus and flagging of bad raters.

Pure functions over plain labels so that they can be checked against synthetic raters whose
answers are known. Labels are small integers ``0..K-1`` (the UI's A, B, tie, both bad).

Why Dawid–Skene and not majority vote: with k raters per item a majority vote trusts a careless
rater as much as a careful one; Dawid–Skene estimates each rater's confusion matrix by EM and
weighs their votes by it, so the consensus (and each rater's estimated accuracy) comes out of
the same fit.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from forge_kit.stats import wilson_interval


@dataclass(frozen=True)
class Label:
    """One answer: rater ``rater`` gave ``label`` to item ``item`` after ``seconds`` on it."""

    item: str
    rater: str
    label: int
    seconds: float = float("nan")


@dataclass(frozen=True)
class DawidSkene:
    """Fit of the Dawid–Skene model.

    ``posterior[item]`` is the distribution over true labels; ``confusion[rater][k, l]`` is
    P(rater says l | truth k); ``accuracy[rater]`` is the rater's expected accuracy under the
    fitted class priors ``priors``.
    """

    posterior: dict[str, np.ndarray]
    confusion: dict[str, np.ndarray]
    priors: np.ndarray
    accuracy: dict[str, float]
    iterations: int

    def consensus(self) -> dict[str, int]:
        """The most probable true label of each item."""
        return {item: int(np.argmax(p)) for item, p in self.posterior.items()}


def _check(labels: Sequence[Label], classes: int) -> None:
    if classes < 2:
        raise ValueError("classes must be at least 2")
    for entry in labels:
        if not 0 <= entry.label < classes:
            raise ValueError(f"label {entry.label} of rater {entry.rater!r} is outside 0..{classes - 1}")


def dawid_skene(
    labels: Sequence[Label], classes: int, *, max_iter: int = 100, tol: float = 1e-6, smoothing: float = 1.0
) -> DawidSkene:
    """Fit Dawid–Skene by EM.

    1. Start the item posteriors from the (soft) majority vote.
    2. M-step: class priors and each rater's confusion matrix from the posteriors (with additive
       ``smoothing`` so a rater seen on few items does not get zero probabilities).
    3. E-step: item posteriors ∝ prior × Π over its raters of P(their label | truth).
    4. Stop when no posterior moves by more than ``tol`` or after ``max_iter`` rounds.
    """
    _check(labels, classes)
    items = sorted({e.item for e in labels})
    raters = sorted({e.rater for e in labels})
    item_ix = {item: i for i, item in enumerate(items)}
    rater_ix = {rater: r for r, rater in enumerate(raters)}
    n_items, n_raters = len(items), len(raters)
    # counts[i, r, l]: how often rater r gave label l to item i (0 or 1 in practice).
    counts = np.zeros((n_items, n_raters, classes))
    for e in labels:
        counts[item_ix[e.item], rater_ix[e.rater], e.label] += 1
    # 1. Majority-vote start.
    votes = counts.sum(axis=1) + 1e-9
    post = votes / votes.sum(axis=1, keepdims=True)
    iterations = 0
    priors = np.full(classes, 1.0 / classes)
    confusion = np.zeros((n_raters, classes, classes))
    for iterations in range(1, max_iter + 1):  # noqa: B007 - the count is reported
        # 2. M-step.
        priors = (post.sum(axis=0) + smoothing) / (n_items + classes * smoothing)
        confusion = np.einsum("ik,irl->rkl", post, counts) + smoothing
        confusion /= confusion.sum(axis=2, keepdims=True)
        # 3. E-step, in logs to stay finite with many raters per item.
        log_post = np.log(priors)[None, :] + np.einsum("irl,rkl->ik", counts, np.log(confusion))
        log_post -= log_post.max(axis=1, keepdims=True)
        new = np.exp(log_post)
        new /= new.sum(axis=1, keepdims=True)
        # 4. Converged?
        moved = float(np.abs(new - post).max()) if n_items else 0.0
        post = new
        if moved < tol:
            break
    accuracy = {rater: float(np.sum(priors * np.diag(confusion[r]))) for rater, r in rater_ix.items()}
    return DawidSkene(
        posterior={item: post[i] for item, i in item_ix.items()},
        confusion={rater: confusion[r] for rater, r in rater_ix.items()},
        priors=priors,
        accuracy=accuracy,
        iterations=iterations,
    )


def cohen_kappa(first: Sequence[int], second: Sequence[int]) -> float:
    """Cohen's kappa of two raters over the same items (NaN when chance agreement is 1)."""
    if len(first) != len(second):
        raise ValueError("both raters must label the same items")
    if not first:
        return float("nan")
    n = len(first)
    observed = sum(a == b for a, b in zip(first, second, strict=True)) / n
    left, right = Counter(first), Counter(second)
    expected = sum(left[k] * right[k] for k in left) / (n * n)
    if expected >= 1.0:
        return float("nan")
    return (observed - expected) / (1.0 - expected)


def kappa_upper_bound(first: Sequence[int], second: Sequence[int], z: float = 1.959964) -> float:
    """Upper end of the 95 % interval of Cohen's kappa (large-sample standard error
    ``sqrt(p_o (1 - p_o) / n) / (1 - p_e)``, Cohen 1960); NaN where kappa is undefined."""
    kappa = cohen_kappa(first, second)
    if kappa != kappa:
        return kappa
    n = len(first)
    observed = sum(a == b for a, b in zip(first, second, strict=True)) / n
    left, right = Counter(first), Counter(second)
    expected = sum(left[k] * right[k] for k in left) / (n * n)
    return kappa + z * math.sqrt(observed * (1.0 - observed) / n) / (1.0 - expected)


def fleiss_kappa(labels: Sequence[Label], classes: int) -> float:
    """Fleiss' kappa over the items with at least two answers.

    Items may have different numbers of raters: each item's agreement is averaged over its own
    rater pairs (the usual generalisation); NaN when fewer than one such item exists.
    """
    _check(labels, classes)
    by_item: dict[str, Counter[int]] = defaultdict(Counter)
    for e in labels:
        by_item[e.item][e.label] += 1
    rows = [c for c in by_item.values() if sum(c.values()) >= 2]
    if not rows:
        return float("nan")
    agreement = []
    totals: Counter[int] = Counter()
    for counts in rows:
        n = sum(counts.values())
        agreement.append((sum(v * v for v in counts.values()) - n) / (n * (n - 1)))
        totals.update(counts)
    grand = sum(totals.values())
    p_bar = float(np.mean(agreement))
    p_e = sum((v / grand) ** 2 for v in totals.values())
    if p_e >= 1.0:
        return float("nan")
    return (p_bar - p_e) / (1.0 - p_e)


@dataclass(frozen=True)
class QualityPolicy:
    """Thresholds for flagging raters; each rule needs ``min_answers`` answers to apply."""

    min_answers: int = 10
    """Fewer answers than this: too little evidence to flag anyone."""
    min_kappa: float = 0.2
    """A rater whose kappa against the consensus is significantly below this (95 % upper bound
    under it) is flagged; significantly below 0 is anti-correlated. Significance, not the point
    value: an honest rater with 30 % noise sits near 0.2 on a few dozen items and must not be
    flagged for chance, while a rater answering at random is, once there is evidence."""
    max_same_share: float = 0.9
    """One choice (e.g. always A) in more than this share of answers flags a rater."""
    min_median_seconds: float = 3.0
    """A median time per item below this flags a rater as too fast to have read both responses."""
    min_gold_accuracy: float = 0.6
    """Gold accuracy whose 95% Wilson upper bound is below this flags a rater: a few unlucky
    gold items do not flag an honest rater, consistent failure does."""
    min_gold: int = 5
    """Gold answers needed before gold accuracy is judged."""


@dataclass
class RaterQuality:
    """What the admin page shows for one rater; ``reasons`` empty means the rater is trusted."""

    rater: str
    answers: int
    gold_answers: int
    gold_accuracy: float
    ds_accuracy: float
    kappa_vs_consensus: float
    kappa_upper_95: float
    agreement_vs_consensus: float
    top_choice_share: float
    median_seconds: float
    reasons: list[str] = field(default_factory=list)

    @property
    def flagged(self) -> bool:
        return bool(self.reasons)

    @property
    def weight(self) -> float:
        """Weight of this rater's labels in training data: 0 when flagged, else DS accuracy."""
        return 0.0 if self.flagged else round(self.ds_accuracy, 4)


@dataclass(frozen=True)
class QualityReport:
    """Rater quality over a set of labels."""

    raters: list[RaterQuality]
    fleiss_kappa: float
    consensus: dict[str, int]

    def flagged(self) -> dict[str, list[str]]:
        return {r.rater: r.reasons for r in self.raters if r.flagged}


def _nan_median(values: Sequence[float]) -> float:
    finite = [v for v in values if v == v]
    return statistics.median(finite) if finite else float("nan")


def assess_raters(
    labels: Sequence[Label],
    classes: int,
    gold: Mapping[str, int],
    policy: QualityPolicy = QualityPolicy(),
) -> QualityReport:
    """Score every rater and flag careless or adversarial ones, each flag with its reason.

    1. Fit Dawid–Skene on all labels; its consensus is the reference for agreement.
    2. Per rater: accuracy on gold items, Cohen's kappa against the consensus computed without
       the rater's own vote (leave-one-out majority, so that a rater cannot agree with themself),
       the share of their most common choice and their median seconds per item.
    3. Flag by the policy's rules: anti-correlated / low agreement, one choice for everything,
       too fast, failing gold items.
    """
    _check(labels, classes)
    # 1. Consensus.
    fit = dawid_skene(labels, classes)
    consensus = fit.consensus()
    by_item: dict[str, list[Label]] = defaultdict(list)
    by_rater: dict[str, list[Label]] = defaultdict(list)
    for e in labels:
        by_item[e.item].append(e)
        by_rater[e.rater].append(e)
    results = []
    for rater in sorted(by_rater):
        mine = by_rater[rater]
        # 2. Leave-one-out reference: DS-weighted vote of the other raters on the item.
        own, ref = [], []
        for e in mine:
            others = [o for o in by_item[e.item] if o.rater != rater]
            if not others:
                continue
            score = np.log(fit.priors).copy()
            for o in others:
                score += np.log(fit.confusion[o.rater][:, o.label])
            own.append(e.label)
            ref.append(int(np.argmax(score)))
        golds = [e for e in mine if e.item in gold]
        gold_acc = sum(e.label == gold[e.item] for e in golds) / len(golds) if golds else float("nan")
        top_share = Counter(e.label for e in mine).most_common(1)[0][1] / len(mine)
        quality = RaterQuality(
            rater=rater,
            answers=len(mine),
            gold_answers=len(golds),
            gold_accuracy=gold_acc,
            ds_accuracy=fit.accuracy[rater],
            kappa_vs_consensus=cohen_kappa(own, ref),
            kappa_upper_95=kappa_upper_bound(own, ref) if own else float("nan"),
            agreement_vs_consensus=(sum(a == b for a, b in zip(own, ref, strict=True)) / len(own))
            if own
            else float("nan"),
            top_choice_share=top_share,
            median_seconds=_nan_median([e.seconds for e in mine]),
        )
        # 3. Rules.
        if quality.answers >= policy.min_answers:
            kappa, upper = quality.kappa_vs_consensus, quality.kappa_upper_95
            if upper == upper and upper < 0:
                quality.reasons.append(
                    f"anti-correlated with consensus (kappa {kappa:.2f}, 95% upper {upper:.2f})"
                )
            elif upper == upper and upper < policy.min_kappa:
                quality.reasons.append(
                    f"low agreement with consensus (kappa {kappa:.2f}, 95% upper {upper:.2f})"
                )
            if top_share > policy.max_same_share:
                quality.reasons.append(f"same choice in {top_share:.0%} of answers")
            if quality.median_seconds == quality.median_seconds and (
                quality.median_seconds < policy.min_median_seconds
            ):
                quality.reasons.append(f"too fast (median {quality.median_seconds:.1f}s per item)")
        if (
            quality.gold_answers >= policy.min_gold
            and wilson_interval(round(gold_acc * len(golds)), len(golds))[1] < policy.min_gold_accuracy
        ):
            quality.reasons.append(f"gold accuracy {gold_acc:.0%} on {quality.gold_answers} gold items")
        results.append(quality)
    return QualityReport(raters=results, fleiss_kappa=fleiss_kappa(labels, classes), consensus=consensus)
