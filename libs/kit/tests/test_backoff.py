"""``forge_kit.backoff`` against real HTTP servers on free ports: an overloaded server that answers
429 with ``Retry-After`` above K requests in flight, a server that drops connections, and one that
answers 400."""

from __future__ import annotations

import asyncio
import email.utils
import random
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from forge_kit.backoff import (
    AIMDLimiter,
    Backoff,
    GaveUp,
    RetryPolicy,
    RetryStats,
    TooLarge,
    parse_retry_after,
    send_with_retries,
)
from forge_kit.http import HttpServer


class Overloaded:
    """A server with room for ``capacity`` requests at once: the rest get 429 + Retry-After."""

    def __init__(self, capacity: int, retry_after: str = "1") -> None:
        self.capacity, self.retry_after = capacity, retry_after
        self.in_flight = self.peak = self.served = self.refused = 0
        self.refused_at: list[float] = []
        self.arrived_at: list[float] = []
        self.app = FastAPI()

        @self.app.post("/work")
        async def work() -> JSONResponse:
            self.arrived_at.append(time.monotonic())
            if self.in_flight >= self.capacity:
                self.refused += 1
                self.refused_at.append(time.monotonic())
                return JSONResponse(
                    {"error": "busy"}, status_code=429, headers={"Retry-After": self.retry_after}
                )
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            try:
                # Long enough that retries overlap here even on a machine too busy to send them
                # promptly (the window's cuts need refusals, in rounds of several in flight).
                await asyncio.sleep(0.1)
            finally:
                self.in_flight -= 1
            self.served += 1
            return JSONResponse({"ok": True})

        @self.app.post("/bad")
        async def bad() -> JSONResponse:
            self.served += 1
            return JSONResponse({"error": "bad request"}, status_code=400)


@pytest.fixture
async def overloaded() -> AsyncIterator[tuple[str, Overloaded]]:
    server_state = Overloaded(capacity=3)
    server = HttpServer(server_state.app, "127.0.0.1", 0)
    await server.start()
    yield f"http://127.0.0.1:{server.port}", server_state
    await server.stop()


async def test_every_request_completes_against_a_server_that_says_slow_down(
    overloaded: tuple[str, Overloaded],
) -> None:
    url, server = overloaded
    limiter = AIMDLimiter(64)
    stats = RetryStats()
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        responses = await asyncio.gather(
            *(
                send_with_retries(lambda: client.post("/work"), limiter, stats=stats, rng=random.Random(i))
                for i in range(40)
            )
        )
    assert [r.status_code for r in responses] == [200] * 40
    assert server.served == 40 and server.refused > 0 and stats.overloads == server.refused
    # The window came down from 64 towards what the server can take.
    assert limiter.lowest <= 8


async def test_retry_after_pauses_every_request(overloaded: tuple[str, Overloaded]) -> None:
    url, server = overloaded
    server.retry_after = "2"
    limiter = AIMDLimiter(64)
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        await asyncio.gather(*(send_with_retries(lambda: client.post("/work"), limiter) for _ in range(12)))
    first_refusal = min(server.refused_at)
    # Requests sent after the first 429 came back wait its Retry-After (slack, half of it, for
    # the requests already on the wire when the refusal was written: late on a loaded machine).
    later = [t for t in server.arrived_at if t > first_refusal + 1.0]
    assert later and min(later) >= first_refusal + 1.9


async def test_a_bad_request_is_returned_at_once(overloaded: tuple[str, Overloaded]) -> None:
    url, server = overloaded
    stats = RetryStats()
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        response = await send_with_retries(lambda: client.post("/bad"), AIMDLimiter(4), stats=stats)
    assert response.status_code == 400 and server.served == 1 and stats.retries == 0


async def test_dropped_connections_are_retried_then_given_up() -> None:
    drops = {"left": 2, "accepted": 0}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        drops["accepted"] += 1
        if drops["left"] > 0:
            drops["left"] -= 1
            writer.close()  # reset mid-request: no status line at all
            return
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    policy = RetryPolicy(attempts=3, base_s=0.01, cap_s=0.05)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
            response = await send_with_retries(lambda: client.get("/"), AIMDLimiter(2), policy=policy)
            assert response.status_code == 200 and drops["accepted"] == 3
            drops["left"] = 10
            with pytest.raises(GaveUp) as caught:
                await send_with_retries(lambda: client.get("/"), AIMDLimiter(2), policy=policy)
            assert "failed 3 times" in str(caught.value) and "RemoteProtocolError" in caught.value.last
    finally:
        server.close()
        await server.wait_closed()


async def test_a_request_refused_even_alone_in_flight_is_too_large(
    overloaded: tuple[str, Overloaded],
) -> None:
    url, server = overloaded
    server.capacity = 0  # nothing fits: whatever the window, the answer is 429
    server.retry_after = "0"
    limiter = AIMDLimiter(8)
    policy = RetryPolicy(base_s=0.001, cap_s=0.002)
    async with httpx.AsyncClient(base_url=url, timeout=5) as client:
        with pytest.raises(TooLarge) as caught:
            await send_with_retries(lambda: client.post("/work"), limiter, policy=policy, split_after=2)
    # 8 -> 4 -> 2 -> 1 took three refusals; then two more at the minimum.
    assert server.refused == 5 and "alone in flight" in str(caught.value)


async def test_a_server_overloaded_past_the_patience_gives_up(overloaded: tuple[str, Overloaded]) -> None:
    url, server = overloaded
    server.capacity = 0
    server.retry_after = "0"
    policy = RetryPolicy(overload_patience_s=0.3, base_s=0.01, cap_s=0.05)
    async with httpx.AsyncClient(base_url=url, timeout=5) as client:
        with pytest.raises(GaveUp) as caught:
            await send_with_retries(lambda: client.post("/work"), AIMDLimiter(4), policy=policy)
    assert "still overloaded" in str(caught.value) and "HTTP 429" in caught.value.last


async def test_the_window_halves_once_per_congestion_event_and_grows_back() -> None:
    limiter = AIMDLimiter(16)
    epochs = [await limiter.acquire() for _ in range(4)]
    for epoch in epochs:  # four answers to requests sent in the same window: one cut
        limiter.overloaded(epoch)
        limiter.release()
    assert limiter.window == 8
    limiter.overloaded(await limiter.acquire())
    limiter.release()
    assert limiter.window == 4
    for _ in range(40):
        limiter.succeeded()
    assert 8 <= limiter.window <= 16
    with pytest.raises(ValueError):
        AIMDLimiter(4, decrease=1.0)


def test_retry_after_reads_seconds_and_dates_and_caps_them() -> None:
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None
    assert parse_retry_after("-5") == 0.0 and parse_retry_after("1e9") == 300.0
    assert parse_retry_after("nan") is None
    now = time.time()
    date = email.utils.formatdate(now + 30, usegmt=True)
    assert parse_retry_after(date, now=now) == pytest.approx(30, abs=1.5)


def test_backoff_doubles_with_jitter_up_to_the_cap_and_resets() -> None:
    backoff = Backoff(0.5, 4.0, rng=random.Random(7))

    delays = [backoff.next_delay() for _ in range(6)]

    for delay, cap in zip(delays, [0.5, 1.0, 2.0, 4.0, 4.0, 4.0], strict=True):
        assert cap / 2 <= delay <= cap
    assert len(set(delays)) == len(delays), "jittered, not a fixed schedule"
    assert backoff.failures == 6
    backoff.reset()
    assert backoff.failures == 0 and backoff.next_delay() <= 0.5


def test_backoff_jitter_range_and_bad_arguments() -> None:
    backoff = Backoff(0.1, 1.0, jitter=(0.5, 1.5), rng=random.Random(1))
    delays = [backoff.next_delay() for _ in range(200)]
    assert all(0.05 <= d <= 1.5 for d in delays) and max(delays) > 1.0
    with pytest.raises(ValueError, match="initial_s"):
        Backoff(0.0, 1.0)
    with pytest.raises(ValueError, match="initial_s"):
        Backoff(2.0, 1.0)
    with pytest.raises(ValueError, match="jitter"):
        Backoff(0.1, 1.0, jitter=(1.0, 0.5))


async def test_backoff_sleep_waits_the_delay_it_returns() -> None:
    backoff = Backoff(0.01, 0.02, rng=random.Random(3))
    started = time.monotonic()
    waited = await backoff.sleep()
    assert 0.005 <= waited <= 0.01 and time.monotonic() - started >= waited * 0.9
