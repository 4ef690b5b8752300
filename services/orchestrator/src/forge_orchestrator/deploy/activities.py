"""Activities of the deployment workflow: what the scheduler says of its replica jobs, whether each
replica answers, and the gateway's replica pool and autoscaling signal.

Job submission and cancellation are the scheduler activities every workflow uses
(:class:`~forge_orchestrator.activities.SchedulerActivities`). Every call here is idempotent:
adding a replica the gateway already routes to, or removing one it does not, is no error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
from forge.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from temporalio import activity
from temporalio.exceptions import ApplicationError

from forge_kit.grpckit import make_channel
from forge_kit.modelref import ModelRef
from forge_orchestrator.activities import failed, state_name


@dataclass
class ObserveInput:
    job_ids: list[str]
    model: str
    """The model every replica must list on ``/v1/models`` to count as healthy."""
    token: str
    """The replicas' credential."""


@dataclass
class ReplicaObservation:
    job_id: str
    state: str
    """The job's state name (``PENDING``, ``RUNNING``, ``FAILED``, …; ``GONE`` when the scheduler
    does not know it)."""
    endpoint: str = ""
    node: str = ""
    message: str = ""
    healthy: bool = False
    """RUNNING, and its ``/v1/models`` answered listing the model."""


@dataclass
class ObserveResult:
    replicas: list[ReplicaObservation] = field(default_factory=list)


@dataclass
class RouteInput:
    url: str
    token: str = ""
    add: bool = True
    """True: into the gateway's pool; False: out of it."""


class DeployActivities:
    """Scheduler reads, replica health checks and gateway admin calls for deployments."""

    def __init__(
        self,
        scheduler_target: str,
        scheduler_token: str,
        gateway_url: str,
        gateway_token: str,
        *,
        rpc_timeout_s: float = 10.0,
        probe_timeout_s: float = 3.0,
    ) -> None:
        self._target, self._token = scheduler_target, scheduler_token
        self._gateway_url = gateway_url.rstrip("/")
        self._gateway_token = gateway_token
        self._rpc_timeout_s = rpc_timeout_s
        self._probe_timeout_s = probe_timeout_s
        self._channel: grpc.aio.Channel | None = None

    def methods(self) -> list[Callable[..., Any]]:
        return [self.deploy_observe, self.deploy_route, self.deploy_autoscale]

    def _stub(self) -> scheduler_pb2_grpc.SchedulerServiceAsyncStub:
        if self._channel is None:
            self._channel = make_channel(self._target, token=self._token)
        return scheduler_pb2_grpc.SchedulerServiceStub(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            channel, self._channel = self._channel, None
            await channel.close(None)

    async def _healthy(self, client: httpx.AsyncClient, endpoint: str, model: str, token: str) -> bool:
        try:
            reply = await client.get(f"{endpoint}/v1/models", headers={"Authorization": f"Bearer {token}"})
            if reply.status_code != 200:
                return False
            served = {str(m.get("id", "")) for m in reply.json().get("data", []) if isinstance(m, dict)}
        except (httpx.HTTPError, ValueError, AttributeError):
            return False
        return model in served

    @activity.defn(name="deploy_observe")
    async def deploy_observe(self, params: ObserveInput) -> ObserveResult:
        """Each replica job's state and endpoint, and whether it answers."""
        name = ModelRef.parse(params.model).name
        out = ObserveResult()
        async with httpx.AsyncClient(timeout=self._probe_timeout_s) as client:
            for job_id in params.job_ids:
                try:
                    reply = await self._stub().GetJob(
                        scheduler_pb2.GetJobRequest(job_id=job_id), timeout=self._rpc_timeout_s
                    )
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.NOT_FOUND:
                        out.replicas.append(ReplicaObservation(job_id, "GONE"))
                        continue
                    raise failed("GetJob", exc) from exc
                job = reply.job
                state = str(state_name(job.state))
                endpoint = job.endpoints[0] if job.endpoints else ""
                healthy = state == "RUNNING" and bool(endpoint)
                if healthy:
                    healthy = await self._healthy(client, endpoint, name, params.token)
                out.replicas.append(
                    ReplicaObservation(
                        job_id,
                        state,
                        endpoint=endpoint,
                        node=job.assigned_nodes[0] if job.assigned_nodes else "",
                        message=job.message[-500:],
                        healthy=healthy,
                    )
                )
        return out

    def _admin(self) -> httpx.AsyncClient:
        if not self._gateway_url:
            raise ApplicationError("no inference gateway is configured", non_retryable=True)
        return httpx.AsyncClient(
            base_url=self._gateway_url,
            headers={"Authorization": f"Bearer {self._gateway_token}"},
            timeout=self._rpc_timeout_s,
        )

    @activity.defn(name="deploy_route")
    async def deploy_route(self, params: RouteInput) -> bool:
        """Add the replica to the gateway's pool, or take it out (its requests finish there);
        True when this call changed the pool."""
        async with self._admin() as admin:
            if params.add:
                reply = await admin.post(
                    "/admin/v1/replicas", json={"url": params.url, "token": params.token}
                )
                done, unchanged = reply.status_code == 201, reply.status_code == 409
            else:
                reply = await admin.delete("/admin/v1/replicas", params={"url": params.url})
                done, unchanged = reply.status_code == 204, reply.status_code == 404
        if not (done or unchanged):
            raise ApplicationError(
                f"gateway replica {'add' if params.add else 'remove'}: HTTP {reply.status_code}: {reply.text[:300]}",
                non_retryable=400 <= reply.status_code < 500 and reply.status_code != 429,
            )
        return done

    @activity.defn(name="deploy_autoscale")
    async def deploy_autoscale(self, model: str) -> int:
        """The gateway's desired replica count for ``model`` (its queue, the replicas' scraped
        ``vllm:num_requests_waiting`` and running, and TTFT); -1 when it has none."""
        name = ModelRef.parse(model).name
        async with self._admin() as admin:
            reply = await admin.get("/admin/v1/autoscaling")
        if reply.status_code != 200:
            raise ApplicationError(f"gateway autoscaling: HTTP {reply.status_code}: {reply.text[:300]}")
        for entry in reply.json().get("models", []):
            if isinstance(entry, dict) and entry.get("model") == name:
                return int(entry.get("desired_replicas", -1))
        return -1
