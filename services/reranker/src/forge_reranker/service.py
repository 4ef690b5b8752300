"""Reranker domain logic: validate a Rerank call, score through the cache, order and cut.

Scores are cached by (scorer version, query, passage) — plus the whole passage set for a scorer
whose scores depend on it — so a repeated RAG query costs cache lookups, not model time. The cache
is an optimisation only: when it fails, the call is scored as if nothing were cached.

Deadline-aware: with a deadline, passages are scored in request order (the retriever's, best
first), a batch at a time, while the measured time per passage says the next one still fits
before the deadline (less ``deadline_margin_ms`` for the reply); what is left unscored follows the
scored passages in request order and the answer says so (``partial``). So the caller's budget,
not a fixed depth, decides how many candidates the cross-encoder sees.

Blended with the first stage: when every scored passage carries the caller's ``retrieval_score``,
the order follows ``(1 - w) * model + w * retrieval`` with both min-max normalised over the scored
passages and ``w`` the ``retrieval_weight`` setting. Forge's small cross-encoder alone reorders a
strong hybrid first stage for the worse (SciFact test 0.726 -> 0.666 at depth 20); blended at
``w = 0.5`` (chosen on NFCorpus's dev split) it adds to it (load/retrieval/RESULTS.md).
"""

from __future__ import annotations

import asyncio
import hashlib
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog
from prometheus_client import Counter

from forge_kit import errors
from forge_kit.cache import Cache
from forge_kit.validate import check_finite
from forge_reranker.config import RerankerSettings
from forge_reranker.scoring import Scorer

log = structlog.get_logger(__name__)

CACHE_LOOKUPS = Counter("forge_reranker_cache_lookups_total", "Score cache lookups", ["outcome"])
PASSAGES_SCORED = Counter("forge_reranker_passages_scored_total", "Passages scored by the model", ["model"])
PARTIAL = Counter("forge_reranker_partial_total", "Rerank calls the deadline cut short", ["model"])
_SCORE = struct.Struct(">d")


@dataclass(frozen=True)
class PassageIn:
    """A candidate passage as the caller sends it."""

    id: str
    text: str
    retrieval_score: float | None = None
    """The first stage's score (higher is better), blended with the model's when every scored
    passage of the call has one."""


@dataclass(frozen=True)
class RankedPassage:
    """A passage of the answer; ``index`` is its position in the request. ``score`` is what the
    order follows: ``model_score`` alone, or its blend with the retrieval score. One the deadline
    left unscored has ``scored`` false and both scores 0."""

    id: str
    score: float
    index: int
    scored: bool = True
    model_score: float = 0.0


@dataclass(frozen=True)
class Reranked:
    """A Rerank answer: ``passages`` best first (cut to top_n), ``scored`` how many of the call's
    passages have a score, ``partial`` whether the deadline left some unscored."""

    passages: list[RankedPassage]
    scored: int
    partial: bool


class Pace:
    """Seconds per passage of the scorer: an exponentially weighted mean of measured batches
    (started from a warm-up) and their mean deviation from it, so the service knows how many
    passages fit in the time left. Planning adds twice the deviation to the mean (as TCP's
    retransmission timer does with round trips): a batch may take longer than the mean says (a
    small batch pays the per-batch overhead over fewer passages, another process takes the core),
    and a call that overruns its deadline gets no answer at all."""

    def __init__(self, weight: float = 0.2, deviations: float = 2.0) -> None:
        self.seconds_per_passage: float | None = None
        self.deviation = 0.0
        self._weight, self._deviations = weight, deviations

    def observe(self, passages: int, seconds: float) -> None:
        if passages <= 0:
            return
        sample = seconds / passages
        mean = self.seconds_per_passage
        if mean is None:
            self.seconds_per_passage = sample
            return
        self.deviation += self._weight * (abs(sample - mean) - self.deviation)
        self.seconds_per_passage = mean + self._weight * (sample - mean)

    def fitting(self, seconds: float) -> int:
        """Passages that fit in ``seconds``; before any measurement, one batch is allowed."""
        if seconds <= 0:
            return 0
        if not self.seconds_per_passage:
            return 1 << 30
        return int(seconds / (self.seconds_per_passage + self._deviations * self.deviation))


def cache_key(version: str, query: str, passage: str, context: str = "") -> str:
    """Cache key of one score; ``context`` identifies the passage set for batch-dependent scorers."""
    h = hashlib.sha256()
    for part in (version, query, passage, context):
        h.update(part.encode("utf-8"))
        h.update(b"\x00")
    return f"score:{h.hexdigest()}"


class RerankerService:
    """Scores passages with one ``Scorer`` through a score cache."""

    def __init__(
        self,
        scorer: Scorer,
        cache: Cache,
        settings: RerankerSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._scorer = scorer
        self._cache = cache
        self._settings = settings
        self._clock = clock
        self.pace = Pace()

    async def warm_up(self, passages: int, text: str) -> None:
        """Score ``passages`` copies of ``text`` once (outside any call) so the first deadline is
        planned from a measured pace, and the model's first, slowest forward pass is paid here."""
        started = self._clock()
        await asyncio.to_thread(self._scorer.score, "warm up", [text] * passages)
        self.pace.observe(passages, self._clock() - started)

    @property
    def model(self) -> str:
        return self._scorer.name

    async def rerank(
        self,
        query: str,
        passages: Sequence[PassageIn],
        top_n: int,
        model: str,
        *,
        time_left_s: float | None = None,
    ) -> Reranked:
        """The ``top_n`` best passages (all when 0), best first; ties keep request order.

        1. Validate the call, naming the field.
        2. Look every score up in the cache.
        3. Score what is missing (the whole set for a batch-dependent scorer) and cache it; with
           ``time_left_s``, in request order and only while the next batch fits before the deadline.
        4. Blend the scores with the passages' retrieval scores when all scored ones carry one.
        5. Order the scored passages by score, the unscored after them in request order; cut to ``top_n``.
        """
        deadline = None if time_left_s is None else self._clock() + time_left_s
        self._validate(query, passages, top_n, model)
        if not passages:
            return Reranked([], 0, False)
        texts = [p.text for p in passages]
        context = _passage_set_digest(texts) if self._scorer.batch_dependent else ""
        keys = [cache_key(self._scorer.version, query, t, context) for t in texts]
        scores = await self._cached(keys)
        missing = [i for i, s in enumerate(scores) if s is None]
        CACHE_LOOKUPS.labels("hit").inc(len(keys) - len(missing))
        CACHE_LOOKUPS.labels("miss").inc(len(missing))
        if self._scorer.batch_dependent:
            if missing:
                await self._score(query, texts, list(range(len(texts))), keys, scores)
        else:
            await self._score_until(query, texts, missing, keys, scores, deadline)
        done = [(i, s) for i, s in enumerate(scores) if s is not None]
        final = blend(
            [s for _, s in done],
            [passages[i].retrieval_score for i, _ in done],
            self._settings.retrieval_weight,
        )
        scored = [
            RankedPassage(id=passages[i].id, score=f, index=i, model_score=s)
            for (i, s), f in zip(done, final, strict=True)
        ]
        scored.sort(key=lambda r: (-r.score, r.index))
        unscored = [
            RankedPassage(id=p.id, score=0.0, index=i, scored=False)
            for i, (p, s) in enumerate(zip(passages, scores, strict=True))
            if s is None
        ]
        if unscored:
            PARTIAL.labels(self._scorer.name).inc()
        ranked = scored + unscored
        return Reranked(ranked[:top_n] if top_n else ranked, len(scored), bool(unscored))

    async def _score_until(
        self,
        query: str,
        texts: list[str],
        missing: list[int],
        keys: list[str],
        scores: list[float | None],
        deadline: float | None,
    ) -> None:
        batch = self._settings.cross_encoder_batch_size
        margin = self._settings.deadline_margin_ms / 1000.0
        first = 0
        while first < len(missing):
            take = len(missing)  # no deadline: one call, which the scorer batches by length
            if deadline is not None:
                take = min(batch, self.pace.fitting(deadline - margin - self._clock()))
                if take <= 0:
                    return
            chunk = missing[first : first + take]
            started = self._clock()
            await self._score(query, texts, chunk, keys, scores)
            self.pace.observe(len(chunk), self._clock() - started)
            first += len(chunk)

    async def _score(
        self, query: str, texts: list[str], which: list[int], keys: list[str], scores: list[float | None]
    ) -> None:
        fresh = await asyncio.to_thread(self._scorer.score, query, [texts[i] for i in which])
        PASSAGES_SCORED.labels(self._scorer.name).inc(len(which))
        for i, value in zip(which, fresh, strict=True):
            scores[i] = float(value)
        await self._store([(keys[i], float(v)) for i, v in zip(which, fresh, strict=True)])

    def _validate(self, query: str, passages: Sequence[PassageIn], top_n: int, model: str) -> None:
        limits = self._settings
        if not query.strip():
            raise errors.ValidationError("query", "must not be empty")
        if len(query) > limits.max_query_chars:
            raise errors.ValidationError("query", f"must be at most {limits.max_query_chars} characters")
        if model and model != self._scorer.name:
            raise errors.ValidationError(
                "model", f"unknown model {model!r}; this server serves {self._scorer.name!r}"
            )
        if len(passages) > limits.max_passages:
            raise errors.ValidationError(
                "passages", f"must have at most {limits.max_passages} entries, got {len(passages)}"
            )
        if top_n > limits.max_passages:
            raise errors.ValidationError("top_n", f"must be at most {limits.max_passages} (0: all)")
        for i, passage in enumerate(passages):
            if not passage.text.strip():
                raise errors.ValidationError(f"passages[{i}].text", "must not be empty")
            if len(passage.text) > limits.max_passage_chars:
                raise errors.ValidationError(
                    f"passages[{i}].text", f"must be at most {limits.max_passage_chars} characters"
                )
            if passage.retrieval_score is not None:
                check_finite(f"passages[{i}].retrieval_score", passage.retrieval_score)

    async def _cached(self, keys: list[str]) -> list[float | None]:
        try:
            values = await asyncio.gather(*(self._cache.get(k) for k in keys))
        except Exception as exc:  # noqa: BLE001 - a cache outage costs time, never the call
            log.warning("score cache unavailable; scoring everything", error=str(exc))
            return [None] * len(keys)
        return [_SCORE.unpack(v)[0] if v is not None and len(v) == _SCORE.size else None for v in values]

    async def _store(self, items: list[tuple[str, float]]) -> None:
        ttl = self._settings.score_cache_ttl_s
        try:
            await asyncio.gather(*(self._cache.set(k, _SCORE.pack(v), ttl) for k, v in items))
        except Exception as exc:  # noqa: BLE001 - see _cached
            log.warning("score cache write failed", error=str(exc))


def blend(model: Sequence[float], retrieval: Sequence[float | None], weight: float) -> list[float]:
    """``(1 - weight) * model + weight * retrieval``, each min-max normalised over the passages
    (a constant list counts 0), when every passage has a retrieval score and ``weight`` is above
    0; otherwise the model's scores unchanged. Min-max keeps a logit and a fused rank score on one
    scale without knowing either's range, and only the order within the call matters."""
    if weight <= 0 or not model or any(r is None for r in retrieval):
        return list(model)
    first = _min_max([float(r) for r in retrieval if r is not None])
    return [(1.0 - weight) * m + weight * r for m, r in zip(_min_max(model), first, strict=True)]


def _min_max(values: Sequence[float]) -> list[float]:
    low, high = min(values), max(values)
    return [(v - low) / (high - low) if high > low else 0.0 for v in values]


def _passage_set_digest(texts: Sequence[str]) -> str:
    h = hashlib.sha256()
    for text in sorted(texts):
        h.update(hashlib.sha256(text.encode("utf-8")).digest())
    return h.hexdigest()
