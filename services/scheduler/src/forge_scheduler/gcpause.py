"""Pausing Python's cyclic garbage collector around a scheduling cycle.

A cycle over a 10,000-job snapshot allocates tens of thousands of short-lived objects, none of
them in reference cycles, so reference counting frees them all. With the cyclic collector on,
those allocations still count towards its thresholds, and every few cycles one of them tips a
full collection that walks the whole process heap — snapshot included — inside the cycle, which
can cost more than the cycle's own work. Paused, the cycle
takes only its own time; the collection runs once the cycle is over, when the collector next
passes a threshold.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Run the body with the cyclic collector off, restoring its state after the outermost
    body ends (safe to nest and to enter from several threads at once)."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
