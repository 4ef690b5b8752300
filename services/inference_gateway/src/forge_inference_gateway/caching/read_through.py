"""A read-through cache for the per-request database reads (API keys, aliases)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import structlog

log = structlog.get_logger(__name__)

K = TypeVar("K")
V = TypeVar("V")


class ReadThrough(Generic[K, V]):
    """Per-request database reads (keys, aliases), kept for ``ttl_s``.

    A missing entry is loaded once however many requests ask at the same moment (50 streams
    arriving together would otherwise make 50 reads). An expired entry is still answered while one
    background read refreshes it, so no request waits on the database once a key is known; a change
    made in this process (``clear``) applies at once, one made elsewhere within ``ttl_s`` and a read.
    """

    def __init__(self, ttl_s: float, clock: Callable[[], float]) -> None:
        self._ttl_s = ttl_s
        self._clock = clock
        self._items: dict[K, tuple[float, V]] = {}
        self._loading: dict[K, asyncio.Future[V]] = {}
        self._refreshing: set[asyncio.Task[None]] = set()
        self._generation = 0

    async def get(self, key: K, load: Callable[[], Awaitable[V]]) -> V:
        item = self._items.get(key)
        if item is not None:
            if item[0] < self._clock() and key not in self._loading:
                task = asyncio.get_running_loop().create_task(self._refresh(key, load))
                self._refreshing.add(task)
                task.add_done_callback(self._refreshing.discard)
            return item[1]
        pending = self._loading.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        return await self._load(key, load)

    async def _load(self, key: K, load: Callable[[], Awaitable[V]]) -> V:
        future: asyncio.Future[V] = asyncio.get_running_loop().create_future()
        self._loading[key] = future
        generation = self._generation
        try:
            value = await load()
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: waiters re-raise it, nobody else needs to
            raise
        else:
            future.set_result(value)
            # A change made while this read ran (``clear``) must not be overwritten by its result.
            if self._ttl_s > 0 and generation == self._generation:
                if len(self._items) > 10_000:
                    self._items.clear()
                self._items[key] = (self._clock() + self._ttl_s, value)
            return value
        finally:
            if self._loading.get(key) is future:
                del self._loading[key]

    async def _refresh(self, key: K, load: Callable[[], Awaitable[V]]) -> None:
        try:
            await self._load(key, load)
        except Exception as exc:  # noqa: BLE001 - gone (a key revoked) or failing: read again next time
            self._items.pop(key, None)
            log.info("read_through.refresh_failed", error=repr(exc))

    def clear(self) -> None:
        self._items.clear()
        self._loading.clear()
        self._generation += 1
