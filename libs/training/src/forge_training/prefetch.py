"""Loader prefetch: a background thread prepares the next steps' batches while the loop trains.

The thread is the only reader of the sampler once started. Each item it hands over carries the
sampler position *after* drawing that step, and the loop records the position of the last item it
consumed; that is what goes into a checkpoint. Batches drawn ahead but never trained on are
simply drawn again after a resume, so read-ahead never shifts the data order.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class Prefetcher(Generic[T]):
    """``count`` items from ``produce``, up to ``depth`` of them ready ahead (0: made on demand).

    Called by the training loop: :meth:`next` once per step, :meth:`close` when the loop leaves
    (also early, on a stop); an exception in ``produce`` is raised by the :meth:`next` that would
    have returned its item. :meth:`peek` shows the next items without handing them out (a
    cooldown branch trains on them; the loop then trains on them again).
    """

    def __init__(self, produce: Callable[[], T], count: int, depth: int) -> None:
        self._produce = produce
        self._remaining = count
        self._depth = depth
        self._stop = threading.Event()
        self._queue: queue.Queue[T | _Failure] = queue.Queue(maxsize=max(1, depth))
        self._ahead: deque[T] = deque()
        self._thread: threading.Thread | None = None
        if depth > 0 and count > 0:
            self._thread = threading.Thread(
                target=self._run, args=(count,), name="forge-prefetch", daemon=True
            )
            self._thread.start()

    def _run(self, count: int) -> None:
        for _ in range(count):
            try:
                item: T | _Failure = self._produce()
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                item = _Failure(exc)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.05)
                    break
                except queue.Full:
                    continue
            if self._stop.is_set() or isinstance(item, _Failure):
                return

    def _take(self) -> T:
        if self._thread is None:
            return self._produce()
        item = self._queue.get()
        if isinstance(item, _Failure):
            raise item.error
        return item

    def next(self) -> T:
        if self._remaining <= 0:
            raise StopIteration("the prefetcher has handed out every item")
        self._remaining -= 1
        return self._ahead.popleft() if self._ahead else self._take()

    def peek(self, count: int) -> list[T]:
        """The next ``count`` items (fewer when fewer are left), which :meth:`next` still hands
        out, in order."""
        count = min(count, self._remaining)
        while len(self._ahead) < count:
            self._ahead.append(self._take())
        return list(self._ahead)[:count]

    def close(self) -> None:
        """Stop reading ahead and wait for the thread (it may be blocked on a full queue)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
