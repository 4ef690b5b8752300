"""Cache and rate limiting behind one interface: Redis when a URL is given, in-process otherwise.

Callers (the gateway's response cache and admission control, the reranker's score cache) depend on
:class:`Cache` only; :func:`make_cache` picks the backend from settings.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

import redis.asyncio as aioredis


class Cache(Protocol):
    """Key/value cache with TTLs and a token-bucket rate limiter."""

    async def get(self, key: str) -> bytes | None:
        """The value, or None when absent or expired."""

    async def set(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
        """Store ``value``; it expires after ``ttl_s`` seconds when given."""

    async def delete(self, key: str) -> None:
        """Remove ``key`` if present."""

    async def allow(self, key: str, rate_per_s: float, burst: int) -> tuple[bool, float]:
        """Take one token from bucket ``key``; returns (allowed, seconds until a token is free)."""

    async def close(self) -> None:
        """Release connections."""


def _check_rate(rate_per_s: float, burst: int) -> None:
    if not (rate_per_s > 0 and math.isfinite(rate_per_s)):
        raise ValueError(f"rate_per_s must be a positive number, got {rate_per_s!r}")
    if burst < 1:
        raise ValueError(f"burst must be at least 1, got {burst!r}")


class InMemoryCache:
    """A bounded LRU with TTLs and token buckets, for one process.

    ``clock`` returns monotonic seconds; tests pass a fake one. At most ``max_entries`` values and
    ``max_entries`` buckets are kept (least recently used go first; an evicted bucket is full).
    """

    def __init__(self, max_entries: int = 10_000, clock: Callable[[], float] | None = None) -> None:
        self._max_entries = max_entries
        self._clock: Callable[[], float] = clock or time.monotonic
        self._data: OrderedDict[str, tuple[bytes, float | None]] = OrderedDict()
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._lock = asyncio.Lock()

    async def get(self, key: str) -> bytes | None:
        item = self._data.get(key)
        if item is None:
            return None
        value, expires = item
        if expires is not None and self._clock() >= expires:
            del self._data[key]
            return None
        self._data.move_to_end(key)
        return value

    async def set(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
        self._data[key] = (value, None if ttl_s is None else self._clock() + ttl_s)
        self._data.move_to_end(key)
        while len(self._data) > self._max_entries:
            self._data.popitem(last=False)

    async def delete(self, key: str) -> None:
        self._data.pop(key, None)

    async def allow(self, key: str, rate_per_s: float, burst: int) -> tuple[bool, float]:
        _check_rate(rate_per_s, burst)
        async with self._lock:
            now = self._clock()
            tokens, last = self._buckets.get(key, (float(burst), now))
            tokens = min(float(burst), tokens + max(0.0, now - last) * rate_per_s)
            allowed = tokens >= 1.0
            if allowed:
                tokens -= 1.0
            self._buckets[key] = (tokens, now)
            self._buckets.move_to_end(key)
            while len(self._buckets) > self._max_entries:
                self._buckets.popitem(last=False)
            return (True, 0.0) if allowed else (False, (1.0 - tokens) / rate_per_s)

    async def close(self) -> None:
        self._data.clear()
        self._buckets.clear()


# Token bucket in one round trip: KEYS[1] bucket; ARGV rate, burst. Returns {allowed, wait_ms}.
# The time is Redis's own, so replicas with skewed clocks share one bucket correctly.
_BUCKET_LUA = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1]) or burst
local ts = tonumber(state[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - ts) / 1000 * rate)
local allowed = 0
local wait = 0
if tokens >= 1 then
  tokens = tokens - 1
  allowed = 1
else
  wait = math.ceil((1 - tokens) / rate * 1000)
end
redis.call('HSET', KEYS[1], 'tokens', tokens, 'ts', now)
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return {allowed, wait}
"""


class RedisCache:
    """The same interface on Redis, shared by every replica; keys are namespaced per service."""

    def __init__(self, url: str, namespace: str) -> None:
        self._redis = aioredis.from_url(url)
        self._ns = namespace
        self._bucket = self._redis.register_script(_BUCKET_LUA)

    def _key(self, key: str) -> str:
        return f"forge:{self._ns}:{key}"

    async def get(self, key: str) -> bytes | None:
        value = await self._redis.get(self._key(key))
        if value is None:
            return None
        return value.encode() if isinstance(value, str) else bytes(value)

    async def set(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
        await self._redis.set(self._key(key), value, px=None if ttl_s is None else max(1, int(ttl_s * 1000)))

    async def delete(self, key: str) -> None:
        await self._redis.delete(self._key(key))

    async def allow(self, key: str, rate_per_s: float, burst: int) -> tuple[bool, float]:
        _check_rate(rate_per_s, burst)
        allowed, wait_ms = await self._bucket(keys=[self._key(f"bucket:{key}")], args=[rate_per_s, burst])
        return bool(allowed), int(wait_ms) / 1000.0

    async def close(self) -> None:
        await self._redis.aclose()


def make_cache(redis_url: str, namespace: str) -> Cache:
    """Redis when ``redis_url`` is set, else an in-process cache."""
    return RedisCache(redis_url, namespace) if redis_url else InMemoryCache()
