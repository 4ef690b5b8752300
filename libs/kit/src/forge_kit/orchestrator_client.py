"""A small client of the OrchestratorService: start, read, wait for and cancel a workflow.

Used by the orchestrator's ``forge workflows`` and ``forge sweep`` commands and by the main-job
steps that start or follow a workflow (the orchestrator's, eval's and the trainer agent's), so
every one of them polls a workflow the same way (:meth:`OrchestratorClient.wait`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import grpc
from forge.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from google.protobuf import json_format, struct_pb2

from forge_kit.grpckit import make_channel

RPC_TIMEOUT_S = 15.0
#: A poll that meets one of these tries again (until its own deadline): the orchestrator or its
#: Temporal did not answer this once, which on a loaded machine happens.
RETRIED_WHILE_WAITING = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def status_name(status: int) -> str:
    """``WORKFLOW_STATUS_COMPLETED`` → ``"COMPLETED"``."""
    return orchestrator_pb2.WorkflowStatus.Name(status).removeprefix("WORKFLOW_STATUS_")  # type: ignore[arg-type]


def response_to_dict(reply: orchestrator_pb2.GetWorkflowResponse) -> dict[str, Any]:
    """GetWorkflow's answer as plain JSON-able data."""
    out: dict[str, Any] = {
        "workflow_id": reply.workflow_id,
        "run_id": reply.run_id,
        "workflow_type": reply.workflow_type,
        "status": status_name(reply.status),
    }
    if reply.HasField("result"):
        out["result"] = json_format.MessageToDict(reply.result)
    if reply.error:
        out["error"] = reply.error
    if reply.HasField("progress"):
        out["progress"] = json_format.MessageToDict(reply.progress)
    if reply.HasField("started_at"):
        out["started_at"] = reply.started_at.ToJsonString()
    if reply.HasField("closed_at"):
        out["closed_at"] = reply.closed_at.ToJsonString()
    return out


class OrchestratorClient:
    """Async client; use as ``async with OrchestratorClient(target, token) as client``."""

    def __init__(self, target: str, token: str | None) -> None:
        self._channel = make_channel(target, token=token)
        self._stub = orchestrator_pb2_grpc.OrchestratorServiceStub(self._channel)

    async def __aenter__(self) -> OrchestratorClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self._channel.close(None)

    async def start(
        self, workflow_type: str, data: Mapping[str, Any] | None = None, workflow_id: str = ""
    ) -> str:
        payload = struct_pb2.Struct()
        payload.update(dict(data or {}))
        request = orchestrator_pb2.StartWorkflowRequest(
            workflow_type=workflow_type, input=payload, workflow_id=workflow_id
        )
        reply = await self._stub.StartWorkflow(request, timeout=RPC_TIMEOUT_S)
        return str(reply.workflow_id)

    async def get(self, workflow_id: str, run_id: str = "") -> orchestrator_pb2.GetWorkflowResponse:
        request = orchestrator_pb2.GetWorkflowRequest(workflow_id=workflow_id, run_id=run_id)
        return await self._stub.GetWorkflow(request, timeout=RPC_TIMEOUT_S)

    async def cancel(self, workflow_id: str, reason: str = "") -> None:
        request = orchestrator_pb2.CancelWorkflowRequest(workflow_id=workflow_id, reason=reason)
        await self._stub.CancelWorkflow(request, timeout=RPC_TIMEOUT_S)

    async def wait(
        self, workflow_id: str, *, timeout_s: float, poll_s: float = 0.5, until_visible: bool = False
    ) -> orchestrator_pb2.GetWorkflowResponse:
        """Poll GetWorkflow until the workflow is no longer RUNNING; TimeoutError after ``timeout_s``.
        A poll answered ``UNAVAILABLE`` or ``DEADLINE_EXCEEDED`` is tried again (until the
        deadline, when that error ends the wait), and so is ``NOT_FOUND`` with ``until_visible``
        (a workflow that another service starts, not visible yet); any other error ends the wait."""
        retried = (
            RETRIED_WHILE_WAITING | {grpc.StatusCode.NOT_FOUND} if until_visible else RETRIED_WHILE_WAITING
        )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                reply = await self.get(workflow_id)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in retried or time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(poll_s)
                continue
            if reply.status != orchestrator_pb2.WORKFLOW_STATUS_RUNNING:
                return reply
            if time.monotonic() >= deadline:
                raise TimeoutError(f"workflow {workflow_id} still RUNNING after {timeout_s:g}s")
            await asyncio.sleep(poll_s)
