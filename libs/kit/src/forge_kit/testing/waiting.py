"""Waiting in tests for a condition, with a deadline generous enough for a loaded machine."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

#: Long enough for the slowest step a test waits for with three test folders on two cores (a
#: Temporal activity, a subprocess importing torch); a condition that does come ends the wait at once.
DEFAULT_TIMEOUT_S = 60.0


async def eventually(
    probe: Callable[[], Any],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    interval_s: float = 0.05,
    what: str = "",
) -> Any:
    """Call ``probe`` (sync or async) until it returns something truthy, and return that.

    Fails the test with ``what`` and the last value when ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    while True:
        result: Any = probe()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g}s: {what or probe} (last: {result!r})")
        await asyncio.sleep(interval_s)
