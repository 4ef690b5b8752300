"""Run one service process: servers, background tasks, graceful shutdown on SIGTERM/SIGINT.

Every ``__main__.py`` builds its parts and hands them to :func:`run_forever`, so start-up order,
the ready file and shutdown are the same everywhere.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from forge_kit.grpckit import GrpcServer
from forge_kit.http import HttpServer

log = structlog.get_logger(__name__)


@dataclass
class ServiceParts:
    """What a running service is made of; ``on_stop`` runs after the servers have stopped."""

    name: str
    grpc: GrpcServer | None = None
    http: HttpServer | None = None
    background: Sequence[Callable[[], Coroutine[Any, Any, None]]] = ()
    on_stop: Sequence[Callable[[], Awaitable[None]]] = field(default_factory=list)


def _write_ready_file(path: str, ports: dict[str, int | None]) -> None:
    # Written under a temporary name and renamed, so a reader never sees half a file.
    tmp = f"{path}.tmp"
    with open(tmp, "w") as handle:
        json.dump(ports, handle)
    os.replace(tmp, path)


def freeze_startup_heap() -> None:
    """Move every object alive after start-up (modules, the app, its routes, ORM metadata, compiled
    protobufs: most of a service's heap) out of the garbage collector's sight.

    CPython's full collections scan every tracked object; for a started service that is mostly
    this start-up heap, which lives as long as the process, so each full collection is work for
    nothing. Frozen (``gc.freeze``, as Instagram does before forking its workers), collections
    scan only what requests allocate. On the preference ingest benchmark this takes most of the
    collector's share of the event loop's time away (figures in ``load/feedback/RESULTS.md``).
    """
    gc.collect()
    gc.freeze()


async def run_forever(parts: ServiceParts, ready_file: str | None = None) -> None:
    """Start background tasks, announce ports, wait for a signal, stop everything in reverse order."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [
        asyncio.create_task(factory(), name=f"{parts.name}-bg-{i}")
        for i, factory in enumerate(parts.background)
    ]
    ports = {
        "grpc_port": parts.grpc.port if parts.grpc else None,
        "http_port": parts.http.port if parts.http else None,
        "pid": os.getpid(),
    }
    freeze_startup_heap()
    log.info("service.started", service=parts.name, **ports)
    ready_file = ready_file or os.environ.get("FORGE_READY_FILE")
    if ready_file:
        _write_ready_file(ready_file, ports)

    async def watch(task: asyncio.Task[None]) -> None:
        try:
            await task
        except asyncio.CancelledError:
            return
        except Exception:  # a dead background loop makes the process unhealthy
            log.exception("service.background_failed", task=task.get_name())
            stop.set()

    watchers = [asyncio.create_task(watch(t)) for t in tasks]
    await stop.wait()
    log.info("service.stopping", service=parts.name)
    if parts.grpc:
        await parts.grpc.stop(grace_s=5.0)
    if parts.http:
        await parts.http.stop()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, *watchers, return_exceptions=True)
    for hook in parts.on_stop:
        await hook()
    log.info("service.stopped", service=parts.name)
