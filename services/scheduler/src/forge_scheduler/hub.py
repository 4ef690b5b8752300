"""Open agent sessions by node name: how the scheduler sends StartJob / PreemptJob / CancelJob
(the domain commands of :mod:`forge_scheduler.commands`; the session's handler in
:mod:`forge_scheduler.api` turns each into its message).

Each ``AgentSession`` stream registers one bounded queue here; the stream's handler drains it.
A command for a node without a session is dropped (``send`` returns False): the node is then
either lost (its jobs are requeued) or will reconnect, and on registration the scheduler re-sends
the commands its database says are outstanding.
"""

from __future__ import annotations

import asyncio

import structlog

from forge_scheduler.commands import AgentCommand

log = structlog.get_logger(__name__)

Command = AgentCommand


class AgentHub:
    """Node name → the command queue of its open session (at most one per node)."""

    def __init__(self, queue_size: int = 1000) -> None:
        self._queue_size = queue_size
        self._queues: dict[str, asyncio.Queue[Command]] = {}

    def open(self, node: str) -> asyncio.Queue[Command]:
        """A new session for ``node`` replaces an older one (the agent reconnected)."""
        queue: asyncio.Queue[Command] = asyncio.Queue(self._queue_size)
        self._queues[node] = queue
        return queue

    def close(self, node: str, queue: asyncio.Queue[Command]) -> None:
        if self._queues.get(node) is queue:
            del self._queues[node]

    def connected(self, node: str) -> bool:
        return node in self._queues

    def send(self, node: str, command: Command) -> bool:
        queue = self._queues.get(node)
        if queue is None:
            log.warning("agent.command_dropped", node=node, command=type(command).__name__)
            return False
        try:
            queue.put_nowait(command)
        except asyncio.QueueFull:
            log.error("agent.command_queue_full", node=node)
            return False
        return True
