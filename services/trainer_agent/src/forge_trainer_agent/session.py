"""The agent's end of ``SchedulerService.AgentSession``: register, heartbeat, report, obey.

:meth:`SchedulerSession.run` is the agent's main loop:

1. open the stream and send ``RegisterNode`` (with the jobs still running here);
2. wait for ``RegisterAck`` (bounded by ``register_timeout_s``) and take the heartbeat interval;
3. until the stream ends: a reader hands every command to the service, a writer sends status
   reports as they are queued and a heartbeat every interval;
4. on any failure, mark the session closed, sleep a capped, jittered backoff, and go to 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any, cast

import grpc
import structlog
from forge.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from google.protobuf import timestamp_pb2
from prometheus_client import Counter, Gauge

from forge_kit.backoff import Backoff
from forge_trainer_agent.service import AgentService

log = structlog.get_logger(__name__)

SESSION_CONNECTED = Gauge(
    "forge_trainer_agent_session_connected", "1 while the AgentSession to the scheduler is open"
)
SESSION_RECONNECTS = Counter(
    "forge_trainer_agent_session_reconnects_total", "AgentSession attempts that ended or failed"
)

AgentCall = grpc.aio.StreamStreamCall[scheduler_pb2.AgentSessionRequest, scheduler_pb2.AgentSessionResponse]
#: What ``call.read()`` returns once the other side has finished (missing from grpc's type stubs).
EOF: object = cast(Any, grpc.aio).EOF


class SessionError(Exception):
    """The scheduler broke the session protocol (e.g. no RegisterAck)."""


class SchedulerSession:
    """Keeps one AgentSession open to the scheduler for the life of the agent."""

    def __init__(
        self,
        service: AgentService,
        channel: grpc.aio.Channel,
        *,
        register_timeout_s: float = 10.0,
        backoff: Backoff | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._service = service
        self._stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        self._register_timeout_s = register_timeout_s
        self._backoff = backoff or Backoff(0.5, 30.0)
        self._monotonic = monotonic
        self.sessions_opened = 0

    async def run(self) -> None:
        """Loop over steps 1-4 until cancelled."""
        while True:
            try:
                await self._session()
                log.warning("agent.session_ended")
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                log.warning("agent.session_failed", code=exc.code().name, details=exc.details())
            except Exception as exc:  # noqa: BLE001 - any failure means: reconnect later
                log.warning("agent.session_failed", error=repr(exc))
            finally:
                self._service.session_closed()
                SESSION_CONNECTED.set(0)
            SESSION_RECONNECTS.inc()
            await asyncio.sleep(self._backoff.next_delay())

    async def _session(self) -> None:
        call: AgentCall = self._stub.AgentSession()  # type: ignore[call-arg]  # messages go through call.write
        try:
            # 1. Announce the node.
            node = self._service.node
            register = scheduler_pb2.RegisterNode(
                node_name=node.name,
                gpus=[g.to_proto() for g in node.gpus],
                topology=node.topology(),
                labels=node.labels,
                running_job_ids=self._service.running_job_ids(),
                job_isolation=node.isolation.to_proto() if node.isolation else None,
            )
            await call.write(scheduler_pb2.AgentSessionRequest(register_node=register))
            # 2. Wait for the acknowledgement.
            first: Any = await asyncio.wait_for(call.read(), timeout=self._register_timeout_s)
            if first is EOF or first.WhichOneof("message") != "register_ack":
                raise SessionError(f"expected register_ack, got {first!r}")
            ack = first.register_ack
            interval = float(ack.heartbeat_interval_seconds) or 5.0
            self._service.session_opened(ack.node_id)
            self._service.request_resync()
            self._backoff.reset()
            self.sessions_opened += 1
            SESSION_CONNECTED.set(1)
            log.info(
                "agent.registered",
                node=node.name,
                node_id=ack.node_id,
                heartbeat_s=interval,
                gpus=len(node.gpus),
            )
            # 3. Read commands and write reports and heartbeats until either side stops.
            reader = asyncio.create_task(self._read(call))
            writer = asyncio.create_task(self._write(call, interval))
            done, pending = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for task in done:
                task.result()
        finally:
            call.cancel()

    async def _read(self, call: AgentCall) -> None:
        while True:
            message: Any = await call.read()
            if message is EOF:
                return
            self._service.submit(message)

    async def _write(self, call: AgentCall, interval_s: float) -> None:
        ready = self._service.outbound_ready
        next_beat = self._monotonic()
        while True:
            ready.clear()
            for report in await self._service.reports():
                await call.write(scheduler_pb2.AgentSessionRequest(job_status_update=report.update))
                await self._service.mark_reported(report)
            now = self._monotonic()
            if now >= next_beat:
                sent_at = timestamp_pb2.Timestamp()
                sent_at.GetCurrentTime()
                beat = scheduler_pb2.Heartbeat(
                    sent_at=sent_at, running_job_ids=self._service.running_job_ids()
                )
                await call.write(scheduler_pb2.AgentSessionRequest(heartbeat=beat))
                next_beat = now + interval_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ready.wait(), timeout=max(0.0, next_beat - self._monotonic()))
