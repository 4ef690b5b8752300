"""A fault-injecting TCP proxy (Toxiproxy-like, asyncio, in a thread of its own).

Put it on the link between a client and a service (the client dials ``proxy.address``, the
proxy dials the service) and change what the link does while traffic flows:

* ``latency_s`` (+ ``jitter_s``): each chunk is delivered that much later, in order.
* ``loss``: what packet loss does to a TCP stream — a chunk is "lost" with this probability and
  delivered after a retransmission timeout (``rto_s``, doubling on each further loss), holding
  back everything behind it (head-of-line blocking). No byte is corrupted or dropped: TCP would
  not drop it either.
* ``reset``: the chance that a new connection is reset (closed at once) instead of forwarded;
  :meth:`FaultProxy.cut` resets every open connection.
* ``bandwidth_bps``: bytes per second each way (a token bucket per direction).
* ``blackhole``: ``"up"`` (client → service), ``"down"`` (service → client) or ``"both"``: that
  direction stops moving bytes without closing anything (a partition, one way or two); new
  connections accepted meanwhile reach the service only once "up" is open again. Bytes held back
  fill bounded queues, then the kernel's buffers, so senders block as across a real partition.
  :meth:`heal` opens everything (``reset=True`` also cuts the held connections, as a long
  partition's TCP retransmission give-up would). Bytes held for a sender that closed or died
  during the partition are never delivered (nobody is left to retransmit them): that connection
  is reset at the heal.

Settings change at runtime from any thread (:meth:`configure`); every connection reads them for
each chunk. Traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from forge_kit.testing import free_port

Direction = Literal["up", "down"]
CHUNK = 16 * 1024
QUEUE_CHUNKS = 16
MAX_RTO_S = 8.0


@dataclass(frozen=True)
class LinkFaults:
    """What the link does now (immutable: :meth:`FaultProxy.configure` swaps it whole)."""

    latency_s: float = 0.0
    jitter_s: float = 0.0
    loss: float = 0.0
    rto_s: float = 0.2
    reset: float = 0.0
    bandwidth_bps: int = 0  # 0: unlimited
    blackhole: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if self.latency_s < 0 or self.jitter_s < 0 or self.rto_s <= 0:
            raise ValueError("latency_s and jitter_s must be >= 0 and rto_s > 0")
        if not (0.0 <= self.loss < 1.0) or not (0.0 <= self.reset <= 1.0):
            raise ValueError("loss must be in [0, 1) and reset in [0, 1]")
        if self.bandwidth_bps < 0:
            raise ValueError("bandwidth_bps must be >= 0")
        if not self.blackhole <= {"up", "down"}:
            raise ValueError(f"blackhole directions are 'up' and 'down', not {sorted(self.blackhole)}")


def directions(which: str) -> frozenset[str]:
    """``"up"``, ``"down"``, ``"both"`` or ``""`` as a set of directions."""
    table = {"": frozenset(), "up": frozenset({"up"}), "down": frozenset({"down"})}
    table["both"] = frozenset({"up", "down"})
    if which not in table:
        raise ValueError(f"direction must be one of {sorted(table)}, not {which!r}")
    return table[which]


@dataclass
class LinkStats:
    connections: int = 0
    resets: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    delayed_chunks: int = 0


class FaultProxy:
    """A TCP proxy from ``127.0.0.1:port`` to ``upstream`` whose faults change at runtime."""

    def __init__(self, upstream: tuple[str, int], port: int | None = None, name: str = "link") -> None:
        self.upstream = upstream
        self.port = port or free_port()
        self.name = name
        self.stats = LinkStats()
        self._faults = LinkFaults()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._open: dict[str, asyncio.Event] = {}
        self._writers: set[asyncio.StreamWriter] = set()
        self._connections: set[asyncio.Task[None]] = set()
        self._ready = threading.Event()
        self._stopping: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._random = random.Random(0)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def faults(self) -> LinkFaults:
        return self._faults

    # Control, from any thread.

    def start(self) -> FaultProxy:
        self._thread = threading.Thread(target=self._main, name=f"fault-proxy-{self.name}", daemon=True)
        self._thread.start()
        if not self._ready.wait(10) or self._error is not None:
            raise RuntimeError(f"fault proxy {self.name} did not start: {self._error!r}")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stopping is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
            self._thread.join(10)

    def configure(self, **changes: object) -> LinkFaults:
        """Change some settings (the rest stay); ``blackhole`` takes ``"up"|"down"|"both"|""``."""
        if isinstance(changes.get("blackhole"), str):
            changes["blackhole"] = directions(str(changes["blackhole"]))
        self._faults = dataclasses.replace(self._faults, **changes)  # type: ignore[arg-type]
        self._sync_blackhole()
        return self._faults

    def partition(self, direction: str = "both") -> None:
        self.configure(blackhole=direction)

    def heal(self, reset: bool = False) -> None:
        """Every fault off; ``reset`` also cuts the connections open now."""
        self._faults = LinkFaults()
        self._sync_blackhole()
        if reset:
            self.cut()

    def cut(self) -> None:
        """Reset every open connection (both ends see it closed)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._cut_all)

    @contextlib.contextmanager
    def faulted(self, **changes: object) -> Iterator[FaultProxy]:
        self.configure(**changes)
        try:
            yield self
        finally:
            self.heal()

    # The loop's side.

    def _sync_blackhole(self) -> None:
        if self._loop is None:
            return
        closed = self._faults.blackhole

        def apply() -> None:
            for direction, event in self._open.items():
                if direction in closed:
                    event.clear()
                else:
                    event.set()

        self._loop.call_soon_threadsafe(apply)

    def _cut_all(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()
            self.stats.resets += 1

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        self._open = {"up": asyncio.Event(), "down": asyncio.Event()}
        for event in self._open.values():
            event.set()
        server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self._sync_blackhole()
        self._ready.set()
        async with server:
            await self._stopping.wait()
            server.close()
            self._cut_all()
            # Let the cut connections end on their own, not be cancelled by the loop's shutdown
            # (which logs each as an error nobody retrieved).
            if self._connections:
                await asyncio.wait(self._connections, timeout=2)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats.connections += 1
        self._writers.add(writer)
        task = asyncio.current_task()
        if task is not None:
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)
        try:
            if self._random.random() < self._faults.reset:
                self.stats.resets += 1
                writer.transport.abort()
                return
            await self._open["up"].wait()  # a partitioned service never sees the connection
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            except OSError:
                writer.transport.abort()
                return
            self._writers.add(up_writer)
            try:
                await asyncio.gather(
                    self._pump("up", reader, up_writer), self._pump("down", up_reader, writer)
                )
            finally:
                self._writers.discard(up_writer)
                up_writer.transport.abort()
        finally:
            self._writers.discard(writer)
            writer.transport.abort()

    async def _pump(
        self, direction: Direction, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Read chunks, stamp each with when the faults let it arrive, deliver in order."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUE_CHUNKS)

        sender_gone = False  # the sender closed or died while this direction was cut off

        async def read() -> None:
            nonlocal sender_gone
            last = 0.0
            try:
                while data := await reader.read(CHUNK):
                    faults = self._faults
                    due = time.monotonic() + faults.latency_s + self._random.uniform(0, faults.jitter_s)
                    rto, delayed = faults.rto_s, False
                    while self._random.random() < faults.loss:  # lost, retransmitted after the RTO
                        due += rto
                        rto, delayed = min(rto * 2, MAX_RTO_S), True
                    self.stats.delayed_chunks += delayed
                    last = max(last, due)  # TCP delivers in order: nothing overtakes a late chunk
                    await queue.put((last, data))
            except (ConnectionError, OSError):
                pass
            sender_gone = not self._open[direction].is_set()
            await queue.put((0.0, b""))

        async def deliver() -> None:
            free_at = 0.0
            while True:
                due, data = await queue.get()
                await self._open[direction].wait()
                if not data:
                    if sender_gone:
                        writer.transport.abort()
                        return
                    with contextlib.suppress(ConnectionError, OSError, RuntimeError):
                        writer.write_eof()
                    return
                bps = self._faults.bandwidth_bps
                if bps:
                    due = max(due, free_at)
                    free_at = max(due, time.monotonic()) + len(data) / bps
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                await self._open[direction].wait()  # a partition that began while waiting
                if sender_gone:
                    # What a sender that died behind a partition had sent never arrives (no one
                    # is left to retransmit it): the connection is reset, nothing delivered.
                    self.stats.resets += 1
                    writer.transport.abort()
                    return
                writer.write(data)
                if direction == "up":
                    self.stats.bytes_up += len(data)
                else:
                    self.stats.bytes_down += len(data)
                try:
                    await writer.drain()
                except (ConnectionError, OSError):
                    return

        reading = asyncio.create_task(read())
        try:
            await deliver()
        finally:
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reading
