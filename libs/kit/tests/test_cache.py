"""InMemoryCache (fake clock) and RedisCache (real Redis): TTL, LRU bound, token buckets."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from forge_kit.cache import InMemoryCache, RedisCache, make_cache


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.mark.asyncio
async def test_values_expire_after_their_ttl() -> None:
    clock = FakeClock()
    cache = InMemoryCache(clock=clock)
    await cache.set("short", b"1", ttl_s=5)
    await cache.set("forever", b"2")
    clock.advance(4.9)
    assert await cache.get("short") == b"1"
    clock.advance(0.2)
    assert await cache.get("short") is None
    clock.advance(10_000)
    assert await cache.get("forever") == b"2"


@pytest.mark.asyncio
async def test_least_recently_used_entry_is_evicted_at_the_bound() -> None:
    cache = InMemoryCache(max_entries=2)
    await cache.set("a", b"a")
    await cache.set("b", b"b")
    assert await cache.get("a") == b"a"  # a is now more recent than b
    await cache.set("c", b"c")
    assert await cache.get("b") is None
    assert await cache.get("a") == b"a"
    assert await cache.get("c") == b"c"
    await cache.delete("a")
    assert await cache.get("a") is None


@pytest.mark.asyncio
async def test_token_bucket_allows_a_burst_then_refills_at_the_rate() -> None:
    clock = FakeClock()
    cache = InMemoryCache(clock=clock)
    assert [(await cache.allow("t", rate_per_s=2, burst=3))[0] for _ in range(3)] == [True] * 3
    allowed, wait = await cache.allow("t", rate_per_s=2, burst=3)
    assert not allowed
    assert wait == pytest.approx(0.5)
    clock.advance(0.25)
    allowed, wait = await cache.allow("t", rate_per_s=2, burst=3)
    assert not allowed
    assert wait == pytest.approx(0.25)
    clock.advance(0.25)
    assert (await cache.allow("t", rate_per_s=2, burst=3))[0]
    # Buckets are independent per key, and idle time never overfills past the burst.
    assert (await cache.allow("other", rate_per_s=2, burst=3))[0]
    clock.advance(3600)
    assert [(await cache.allow("t", rate_per_s=2, burst=3))[0] for _ in range(4)] == [True] * 3 + [False]


@pytest.mark.asyncio
async def test_token_buckets_are_bounded_too() -> None:
    cache = InMemoryCache(max_entries=10)
    for i in range(100):
        await cache.allow(f"ip-{i}", rate_per_s=1, burst=1)
    assert len(cache._buckets) == 10


@pytest.mark.asyncio
async def test_nonsense_rates_are_rejected() -> None:
    cache = InMemoryCache()
    with pytest.raises(ValueError, match="rate_per_s"):
        await cache.allow("t", rate_per_s=0, burst=1)
    with pytest.raises(ValueError, match="burst"):
        await cache.allow("t", rate_per_s=1, burst=0)


def test_make_cache_picks_the_backend() -> None:
    assert isinstance(make_cache("", "svc"), InMemoryCache)


@pytest_asyncio.fixture
async def redis_cache(redis_url: str) -> AsyncIterator[RedisCache]:
    cache = RedisCache(redis_url, namespace=f"test-{uuid.uuid4().hex}")
    yield cache
    await cache.close()


@pytest.mark.integration
@pytest.mark.asyncio
async def test_redis_get_set_delete_and_ttl(redis_cache: RedisCache, redis_url: str) -> None:
    assert await redis_cache.get("k") is None
    await redis_cache.set("k", b"\x00v")
    await redis_cache.set("short", b"s", ttl_s=2.0)  # outlives the reads below on a loaded machine
    assert await redis_cache.get("k") == b"\x00v"
    assert await redis_cache.get("short") == b"s"
    await asyncio.sleep(2.1)
    assert await redis_cache.get("short") is None
    await redis_cache.delete("k")
    assert await redis_cache.get("k") is None
    # Namespaces keep services apart.
    other = RedisCache(redis_url, namespace=f"test-{uuid.uuid4().hex}")
    await redis_cache.set("shared", b"mine")
    assert await other.get("shared") is None
    await other.close()


@pytest.mark.integration
@pytest.mark.asyncio
async def test_redis_token_bucket_denies_then_allows_after_the_wait(redis_cache: RedisCache) -> None:
    # One token a second: the three calls take far less on a loaded machine, so none is refilled.
    results = [await redis_cache.allow("b", rate_per_s=1, burst=2) for _ in range(3)]
    assert [allowed for allowed, _ in results] == [True, True, False]
    wait = results[2][1]
    assert 0 < wait <= 1.0
    await asyncio.sleep(wait + 0.02)
    assert (await redis_cache.allow("b", rate_per_s=1, burst=2))[0]
    assert (await redis_cache.allow("another", rate_per_s=1, burst=2))[0]
