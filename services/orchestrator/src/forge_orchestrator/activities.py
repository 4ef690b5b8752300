"""Activities: every piece of I/O a workflow does, here calls to the scheduler over gRPC.

A failed call becomes an ``ApplicationError`` typed with the gRPC status name and saying which
call failed. A status that retrying cannot fix (bad argument, missing resource, bad token) is
non-retryable; anything else (``UNAVAILABLE``, deadline) is retried under the workflow's bounded
retry policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
from forge.common.v1 import common_pb2
from forge.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from temporalio import activity
from temporalio.exceptions import ApplicationError

from forge_kit.grpckit import LazyChannel
from forge_kit.jobstate import JobState
from forge_orchestrator.routing import AUTO_EVAL_LABEL, WORKFLOW_ID_LABEL, Routing

#: Status codes that a retry cannot change.
PERMANENT = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)


def state_name(state: int) -> JobState:
    """``JOB_STATE_CANCELLED`` → ``JobState.CANCELLED`` (a ``str``, ``"CANCELLED"``): the names
    workflows and their results use."""
    return JobState.from_proto(state)


@dataclass
class SubmitJobInput:
    """A job a workflow wants run; ``request_id`` makes a retried submission return the same job."""

    name: str
    team: str
    command: list[str]
    request_id: str
    priority_class: str = "normal"
    labels: dict[str, str] = field(default_factory=dict)
    gpu_count: int = 0
    gpu_type: str = ""
    replicas: int = 1
    checkpointable: bool = False
    kind: str = ""
    """``training``, ``fine_tune``, ``inference``, ``eval`` or empty."""
    on_behalf_of: str = ""
    """The team whose rights the submission acts with (a team caller's workflow); empty: the
    orchestrator's own (an admin caller's workflow)."""
    workflow_id: str = ""
    """The workflow that waits for the job's events (typed routing; a ``workflow_id`` label, the
    older way, is read as the same)."""
    auto_eval: bool = True
    """Whether the job's success triggers the automatic evaluation (an ``auto_eval=false`` label,
    the older way, is read as False)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables of the job's command."""


@dataclass
class CancelJobInput:
    job_id: str
    reason: str


def failed(call: str, exc: grpc.aio.AioRpcError) -> ApplicationError:
    """An ApplicationError naming the call and status; non-retryable when retrying cannot help."""
    code = exc.code()
    return ApplicationError(
        f"{call}: {code.name}: {exc.details()}", type=code.name, non_retryable=code in PERMANENT
    )


class SchedulerActivities:
    """Scheduler calls for workflows. One instance per worker; its channel opens on first use so
    it belongs to the worker's event loop."""

    def __init__(self, target: str, token: str, *, rpc_timeout_s: float = 10.0) -> None:
        self._rpc_timeout_s = rpc_timeout_s
        self._channel = LazyChannel(target, token)

    def _stub(self) -> scheduler_pb2_grpc.SchedulerServiceAsyncStub:
        return scheduler_pb2_grpc.SchedulerServiceStub(self._channel.get())

    async def close(self) -> None:
        await self._channel.close()

    @activity.defn(name="ensure_team")
    async def ensure_team(self, team: str) -> bool:
        """Create ``team`` unless it exists; True when this call created it."""
        try:
            await self._stub().CreateTeam(
                scheduler_pb2.CreateTeamRequest(name=team), timeout=self._rpc_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.ALREADY_EXISTS:
                return False
            raise failed("CreateTeam", exc) from exc
        return True

    @activity.defn(name="submit_job")
    async def submit_job(self, params: SubmitJobInput) -> str:
        """Submit the job; returns its id."""
        legacy = Routing.read(None, params.labels)
        routing = Routing(params.workflow_id or legacy.workflow_id, params.auto_eval and legacy.auto_eval)
        # The labels mirror the typed hints for readers that predate them (rolling upgrades).
        labels = dict(params.labels)
        if routing.workflow_id:
            labels[WORKFLOW_ID_LABEL] = routing.workflow_id
        if not routing.auto_eval:
            labels[AUTO_EVAL_LABEL] = "false"
        spec = scheduler_pb2.JobSpec(
            name=params.name,
            team=params.team,
            priority_class=params.priority_class,
            command=params.command,
            env=params.env,
            labels=labels,
            routing=routing.to_proto(),
            resources=common_pb2.ResourceRequest(gpu_count=params.gpu_count, gpu_type=params.gpu_type),
            replicas=params.replicas,
            checkpointable=params.checkpointable,
            kind=scheduler_pb2.JobKind.Value(f"JOB_KIND_{params.kind.upper()}") if params.kind else 0,  # type: ignore[arg-type]
        )
        request = scheduler_pb2.SubmitJobRequest(
            spec=spec, request_id=params.request_id, on_behalf_of=params.on_behalf_of
        )
        try:
            reply = await self._stub().SubmitJob(request, timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise failed("SubmitJob", exc) from exc
        activity.logger.info("submitted job %s (%s)", reply.job.id, params.name)
        return str(reply.job.id)

    @activity.defn(name="cancel_job")
    async def cancel_job(self, params: CancelJobInput) -> str:
        """Cancel the job (idempotent in the scheduler); returns its state name afterwards."""
        request = scheduler_pb2.CancelJobRequest(job_id=params.job_id, reason=params.reason)
        try:
            reply = await self._stub().CancelJob(request, timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise failed("CancelJob", exc) from exc
        return state_name(reply.job.state)
