"""Backing off between retries, and calling a model server that may say "slow down".

:class:`Backoff` is the one capped, jittered exponential delay every retry loop in Forge sleeps
(the outbox relay and the consumer while Kafka is away, a handler's retries, the orchestrator
waiting for Temporal, the node agent reconnecting to the scheduler).

Every Forge HTTP client that sends many requests to a model server (the eval harness and backend)
goes through :func:`send_with_retries` with one :class:`AIMDLimiter` per endpoint:

- The limiter is a semaphore whose window adapts like TCP's congestion window (AIMD): each success
  adds ``increase / window`` (about one more slot per window of successes, up to ``limit``); an
  overload (429, 503) multiplies it by ``decrease`` (at least ``minimum``), once per congestion
  event: answers to requests sent before the last cut do not cut again.
- An overload's ``Retry-After`` (seconds or an HTTP date) pauses every new request, not only the one
  refused; without one the request backs off (capped, full jitter).
- Overloads are retried until ``RetryPolicy.overload_patience_s`` has passed for that request: a
  server that says "slow down" never fails a run that it would serve given time. Other transient
  failures (500, 502, 504, 408, connection errors) are retried ``attempts`` times. Anything else
  (400, 401, 403, 404, 422 …) is returned to the caller at once: retrying cannot fix it.

``tenacity`` retries one call at a time; what is needed here is one window shared by every call in
flight that 429s shrink, and a pause that a ``Retry-After`` imposes on all of them, so the limiter
and the retry loop are one small piece.
"""

from __future__ import annotations

import asyncio
import email.utils
import math
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx


class Backoff:
    """Capped exponential backoff with jitter: the n-th delay (from 0) is uniform in
    [``jitter[0]``·cap, ``jitter[1]``·cap] where cap = min(``max_s``, ``initial_s``·2^n), so
    clients that lost the same server spread out instead of returning together."""

    def __init__(
        self,
        initial_s: float,
        max_s: float,
        *,
        jitter: tuple[float, float] = (0.5, 1.0),
        rng: random.Random | None = None,
    ) -> None:
        if not 0 < initial_s <= max_s:
            raise ValueError(f"need 0 < initial_s <= max_s; got {initial_s=} {max_s=}")
        if not 0 <= jitter[0] <= jitter[1]:
            raise ValueError(f"need 0 <= jitter low <= jitter high; got {jitter=}")
        self._initial_s, self._max_s = initial_s, max_s
        self._jitter = jitter
        self._rng = rng or random.Random()
        self._failures = 0

    @property
    def failures(self) -> int:
        """Delays handed out since the last :meth:`reset`."""
        return self._failures

    def next_delay(self) -> float:
        cap = min(self._max_s, self._initial_s * 2 ** min(self._failures, 30))
        self._failures += 1
        return self._rng.uniform(cap * self._jitter[0], cap * self._jitter[1])

    async def sleep(self) -> float:
        """Sleep the next delay; returns it."""
        delay = self.next_delay()
        await asyncio.sleep(delay)
        return delay

    def reset(self) -> None:
        """After a success: the next failure waits the initial delay again."""
        self._failures = 0


OVERLOAD_STATUSES = frozenset({429, 503})
"""The server is busy: shrink the window and wait (honouring ``Retry-After``)."""

TRANSIENT_STATUSES = frozenset({408, 500, 502, 504})
"""Worth a few more tries with backoff; the window is left alone."""

MAX_RETRY_AFTER_S = 300.0
"""A ``Retry-After`` longer than this is read as this: a hostile or broken header cannot park a run."""


class AIMDLimiter:
    """A concurrency window of ``minimum``..``limit`` slots, grown additively on success and cut
    multiplicatively on overload; :meth:`pause` holds every new acquisition until a time."""

    def __init__(
        self,
        limit: int,
        *,
        initial: int | None = None,
        minimum: int = 1,
        increase: float = 1.0,
        decrease: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if limit < 1 or not 1 <= minimum <= limit:
            raise ValueError(f"need 1 <= minimum <= limit; got {minimum=} {limit=}")
        if increase <= 0 or not 0 < decrease < 1:
            raise ValueError(f"need increase > 0 and 0 < decrease < 1; got {increase=} {decrease=}")
        self.limit, self.minimum = limit, minimum
        self._window = float(min(limit, max(minimum, initial if initial is not None else limit)))
        self._increase, self._decrease = increase, decrease
        self._clock = clock
        self._in_flight = 0
        self._epoch = 0
        self._paused_until = 0.0
        self._changed = asyncio.Event()
        self.overloads = 0
        """Overload answers seen (each shrinks the window at most once per congestion event)."""
        self.lowest = self._window
        """The smallest the window has been."""

    @property
    def window(self) -> int:
        """Requests allowed in flight now."""
        return max(self.minimum, math.floor(self._window))

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def acquire(self) -> int:
        """Wait for a slot (and for any pause to end); returns the epoch to hand back to
        :meth:`overloaded`."""
        while True:
            wait = self._paused_until - self._clock()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            if self._in_flight < self.window:
                self._in_flight += 1
                return self._epoch
            self._changed.clear()
            await self._changed.wait()

    def release(self) -> None:
        self._in_flight -= 1
        self._changed.set()

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[int]:
        epoch = await self.acquire()
        try:
            yield epoch
        finally:
            self.release()

    def succeeded(self) -> None:
        """Additive increase: about one slot more per window's worth of successes."""
        self._window = min(float(self.limit), self._window + self._increase / self._window)
        self._changed.set()

    def overloaded(self, epoch: int, retry_after_s: float | None = None) -> None:
        """Multiplicative decrease, once per congestion event (a request sent before the last cut
        does not cut again); a ``retry_after_s`` pauses every new request that long."""
        self.overloads += 1
        if epoch == self._epoch:
            self._window = max(float(self.minimum), self._window * self._decrease)
            self.lowest = min(self.lowest, self._window)
            self._epoch += 1
        if retry_after_s is not None and retry_after_s > 0:
            self._paused_until = max(self._paused_until, self._clock() + retry_after_s)


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or an HTTP date), at most
    :data:`MAX_RETRY_AFTER_S`; None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    if not math.isfinite(seconds):
        return None
    return min(MAX_RETRY_AFTER_S, max(0.0, seconds))


@dataclass(frozen=True)
class RetryPolicy:
    """How long to keep trying. Backoff is "full jitter": uniform in [0, min(cap, base·2^n)]."""

    attempts: int = 6
    """Tries for a transient failure that is not an overload (5xx, connection error)."""
    overload_patience_s: float = 900.0
    """How long one request keeps retrying overload answers before the call gives up."""
    base_s: float = 0.25
    cap_s: float = 30.0

    def delay(self, retry: int, rng: random.Random) -> float:
        return rng.uniform(0.0, min(self.cap_s, self.base_s * 2**retry))


@dataclass
class RetryStats:
    """What the retry loop did, for a run's summary."""

    calls: int = 0
    retries: int = 0
    overloads: int = 0
    transient: int = 0
    waited_s: float = 0.0
    errors: list[str] = field(default_factory=list)


class GaveUp(Exception):
    """Retries are exhausted; ``last`` says what the server (or the connection) answered last."""

    def __init__(self, message: str, last: str) -> None:
        super().__init__(message)
        self.last = last


class TooLarge(GaveUp):
    """The server kept refusing this request as overloaded while it was the only one in flight:
    the request alone is more than the server takes (a batch larger than its queue). Split it."""


async def send_with_retries(
    send: Callable[[], Awaitable[httpx.Response]],
    limiter: AIMDLimiter,
    *,
    policy: RetryPolicy | None = None,
    stats: RetryStats | None = None,
    rng: random.Random | None = None,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    clock: Callable[[], float] = time.monotonic,
    split_after: int | None = None,
) -> httpx.Response:
    """``send()`` inside a limiter slot until it answers something retrying cannot change.

    1. Take a slot (waiting for any ``Retry-After`` pause); send.
    2. 2xx/3xx: grow the window and return. 429/503: cut the window, pause for ``Retry-After``
       (or back off) and retry while the request's patience lasts. 5xx/408/connection error:
       back off and retry up to ``policy.attempts`` tries. Any other status: return it.
    3. Out of retries: :class:`GaveUp` naming the last answer. With ``split_after``, that many
       overloads answered while the window was already at its minimum raise :class:`TooLarge`:
       a caller that batches splits the batch (it would never fit otherwise).
    """
    policy = policy or RetryPolicy()
    stats = stats if stats is not None else RetryStats()
    rng = rng or random.Random()
    started = clock()
    transient = 0
    retry = 0
    alone = 0
    while True:
        stats.calls += 1
        async with limiter.slot() as epoch:
            response: httpx.Response | None
            try:
                response = await send()
            except (httpx.TransportError, ConnectionError) as exc:
                response, last = None, f"{type(exc).__name__}: {exc}"
            else:
                last = f"HTTP {response.status_code}: {response.text[:200]}"
        if response is not None and response.status_code in OVERLOAD_STATUSES:
            retry_after = parse_retry_after(response.headers.get("retry-after"))
            at_minimum = limiter.window == limiter.minimum and limiter.in_flight == 0
            limiter.overloaded(epoch, retry_after)
            stats.overloads += 1
            alone += at_minimum
            if split_after is not None and alone >= split_after:
                raise TooLarge(f"refused {alone} times while alone in flight", last)
            if clock() - started >= policy.overload_patience_s:
                raise GaveUp(f"still overloaded after {policy.overload_patience_s:.0f} s", last)
            wait = retry_after if retry_after is not None else policy.delay(retry, rng)
        elif response is None or response.status_code in TRANSIENT_STATUSES:
            transient += 1
            stats.transient += 1
            if transient >= policy.attempts:
                raise GaveUp(f"failed {transient} times", last)
            wait = policy.delay(retry, rng)
        else:
            if response.status_code < 400:
                limiter.succeeded()
            return response
        retry += 1
        stats.retries += 1
        stats.waited_s += wait
        if wait > 0:
            await sleep(wait)
