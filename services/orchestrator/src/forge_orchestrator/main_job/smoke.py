"""The ``smoke`` step of the platform main job (order 10): the ``smoke`` workflow, through every
layer: a gRPC call into the orchestrator, a Temporal workflow calling the scheduler, and the
scheduler's job events coming back through Kafka to the orchestrator's consumer."""

from __future__ import annotations

from forge.orchestrator.v1 import orchestrator_pb2
from google.protobuf import json_format

from forge_kit.mainjob import MainJobContext
from forge_kit.orchestrator_client import OrchestratorClient, status_name

#: How long the smoke workflow may take before the step gives up waiting on it.
SMOKE_WAIT_S = 90.0


async def smoke(ctx: MainJobContext) -> dict[str, object]:
    """Start the ``smoke`` workflow on the orchestrator and wait for it: a gRPC call into the
    orchestrator, a Temporal workflow calling the scheduler, and the scheduler's job events
    coming back through Kafka to the orchestrator's consumer."""
    endpoint = ctx.endpoint("orchestrator")
    async with OrchestratorClient(endpoint.grpc_target, endpoint.token) as client:
        workflow_id = await client.start("smoke", {"timeout_s": SMOKE_WAIT_S / 2})
        reply = await client.wait(workflow_id, timeout_s=SMOKE_WAIT_S)
    if reply.status != orchestrator_pb2.WORKFLOW_STATUS_COMPLETED:
        ended = status_name(reply.status)
        raise RuntimeError(f"smoke workflow {workflow_id} ended {ended}: {reply.error or 'no error given'}")
    result = json_format.MessageToDict(reply.result)
    return {
        "ok": True,
        "workflow_id": workflow_id,
        "job_id": result["job_id"],
        "states_seen": list(result["states_seen"]),
        "elapsed_s": result["elapsed_s"],
    }


smoke.order = 10  # type: ignore[attr-defined]
smoke.timeout_s = SMOKE_WAIT_S + 30  # type: ignore[attr-defined]
