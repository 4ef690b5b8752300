"""Reranker domain logic: validate a Rerank call, score through the cache, order and cut.

Scores are cached by (scorer version, query, passage) — plus the whole passage set for a scorer
whose scores depend on it — so a repeated RAG query costs cache lookups, not model time. The cache
is an optimisation only: when it fails, the call is scored as if nothing were cached.
"""

from __future__ import annotations

import asyncio
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import structlog
from prometheus_client import Counter

from forge_kit import errors
from forge_kit.cache import Cache
from forge_reranker.config import RerankerSettings
from forge_reranker.scoring import Scorer

log = structlog.get_logger(__name__)

CACHE_LOOKUPS = Counter("forge_reranker_cache_lookups_total", "Score cache lookups", ["outcome"])
PASSAGES_SCORED = Counter("forge_reranker_passages_scored_total", "Passages scored by the model", ["model"])
_SCORE = struct.Struct(">d")


@dataclass(frozen=True)
class PassageIn:
    """A candidate passage as the caller sends it."""

    id: str
    text: str


@dataclass(frozen=True)
class RankedPassage:
    """A scored passage; ``index`` is its position in the request."""

    id: str
    score: float
    index: int


def cache_key(version: str, query: str, passage: str, context: str = "") -> str:
    """Cache key of one score; ``context`` identifies the passage set for batch-dependent scorers."""
    h = hashlib.sha256()
    for part in (version, query, passage, context):
        h.update(part.encode("utf-8"))
        h.update(b"\x00")
    return f"score:{h.hexdigest()}"


class RerankerService:
    """Scores passages with one ``Scorer`` through a score cache."""

    def __init__(self, scorer: Scorer, cache: Cache, settings: RerankerSettings) -> None:
        self._scorer = scorer
        self._cache = cache
        self._settings = settings

    @property
    def model(self) -> str:
        return self._scorer.name

    async def rerank(
        self, query: str, passages: Sequence[PassageIn], top_n: int, model: str
    ) -> list[RankedPassage]:
        """The ``top_n`` best passages (all when 0), best first; ties keep request order.

        1. Validate the call, naming the field.
        2. Look every score up in the cache.
        3. Score what is missing (the whole set for a batch-dependent scorer) and cache it.
        4. Order by score and cut to ``top_n``.
        """
        self._validate(query, passages, top_n, model)
        if not passages:
            return []
        texts = [p.text for p in passages]
        context = _passage_set_digest(texts) if self._scorer.batch_dependent else ""
        keys = [cache_key(self._scorer.version, query, t, context) for t in texts]
        scores = await self._cached(keys)
        missing = [i for i, s in enumerate(scores) if s is None]
        CACHE_LOOKUPS.labels("hit").inc(len(keys) - len(missing))
        CACHE_LOOKUPS.labels("miss").inc(len(missing))
        if missing:
            to_score = list(range(len(texts))) if self._scorer.batch_dependent else missing
            fresh = await asyncio.to_thread(self._scorer.score, query, [texts[i] for i in to_score])
            PASSAGES_SCORED.labels(self._scorer.name).inc(len(to_score))
            for i, value in zip(to_score, fresh, strict=True):
                scores[i] = float(value)
            await self._store([(keys[i], float(v)) for i, v in zip(to_score, fresh, strict=True)])
        ranked = sorted(
            (
                RankedPassage(id=p.id, score=s if s is not None else 0.0, index=i)
                for i, (p, s) in enumerate(zip(passages, scores, strict=True))
            ),
            key=lambda r: (-r.score, r.index),
        )
        return ranked[:top_n] if top_n else ranked

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


def _passage_set_digest(texts: Sequence[str]) -> str:
    h = hashlib.sha256()
    for text in sorted(texts):
        h.update(hashlib.sha256(text.encode("utf-8")).digest())
    return h.hexdigest()
