"""The trainer agents as catch-up sources: where each node's outbox is read for the events the
broker lost (``TrainingMetrics`` above all: a sweep's trials and their tracked runs need every
step, and a broker that keeps nothing across a restart forgets what was published and not yet
consumed).

Each agent labels its node with the host:port of its gRPC server (``forge.ai/event-log``); the
scheduler's ``ListNodes`` hands the labels out, so agents that join later are found at the next
round. A label that is not a plain host:port is skipped: the address reaches a gRPC channel.
"""

from __future__ import annotations

import re

import structlog
from forge.common.v1 import common_pb2
from forge.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

from forge_kit.eventlog import CatchUpSource
from forge_kit.grpckit import LazyChannel

log = structlog.get_logger(__name__)

#: The node label a trainer agent publishes its gRPC address in (the agent's own constant).
EVENT_LOG_LABEL = "forge.ai/event-log"
_HOST_PORT = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252}):[0-9]{1,5}$")
#: Pages of nodes read per round at most (1000 nodes).
MAX_PAGES = 10


def event_log_target(labels: dict[str, str]) -> str:
    """The node's event-log address, or "" when it has none or it is no host:port."""
    target = labels.get(EVENT_LOG_LABEL, "")
    if not target:
        return ""
    if not _HOST_PORT.fullmatch(target) or not 0 < int(target.rsplit(":", 1)[1]) < 65536:
        log.warning("agent_logs.bad_address", label=target[:80])
        return ""
    return target


class AgentEventLogs:
    """Called by :class:`forge_kit.eventlog.CatchUp` each round: one source per labelled node."""

    def __init__(self, scheduler_target: str, scheduler_token: str, agent_token: str) -> None:
        self._agent_token = agent_token
        self._channel = LazyChannel(scheduler_target, scheduler_token)

    async def __call__(self) -> list[CatchUpSource]:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(self._channel.get())
        sources: dict[str, CatchUpSource] = {}
        token = ""
        for _ in range(MAX_PAGES):
            page = common_pb2.PageRequest(page_size=100, page_token=token)
            reply = await stub.ListNodes(scheduler_pb2.ListNodesRequest(page=page), timeout=10)
            for node in reply.nodes:
                if target := event_log_target(dict(node.labels)):
                    # One watermark per node: each agent's outbox numbers its own rows.
                    producer = f"trainer_agent@{node.name[:200]}"
                    sources[producer] = CatchUpSource(producer, target, self._agent_token)
            token = reply.page.next_page_token
            if not token:
                break
        return list(sources.values())

    async def close(self) -> None:
        await self._channel.close()
