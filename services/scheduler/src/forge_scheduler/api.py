"""gRPC servicer of ``forge.scheduler.v1.SchedulerService``: translation only."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import AsyncIterator

import grpc
import structlog
from forge.common.v1 import common_pb2
from forge.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from google.protobuf import timestamp_pb2

from forge_kit import errors
from forge_kit.paging import decode_page, page_info
from forge_scheduler.service import QueueStats, SchedulerService, TeamView
from forge_scheduler.store import JobRow, NodeRow

log = structlog.get_logger(__name__)


def _ts(value: dt.datetime | None) -> timestamp_pb2.Timestamp | None:
    if value is None:
        return None
    stamp = timestamp_pb2.Timestamp()
    stamp.FromDatetime(value.replace(tzinfo=dt.UTC))
    return stamp


def job_to_proto(job: JobRow) -> scheduler_pb2.Job:
    return scheduler_pb2.Job(
        id=job.id,
        spec=scheduler_pb2.JobSpec.FromString(job.spec),
        state=job.state,  # type: ignore[arg-type]
        created_at=_ts(job.created_at),
        started_at=_ts(job.started_at),
        finished_at=_ts(job.finished_at),
        assigned_nodes=list(job.assigned_nodes),
        message=job.message,
        preemption_count=job.preemption_count,
    )


def team_to_proto(team: TeamView) -> scheduler_pb2.Team:
    return scheduler_pb2.Team(
        name=team.name,
        display_name=team.display_name,
        created_at=_ts(team.created_at),
        quotas=[
            scheduler_pb2.Quota(
                gpu_type=q.gpu_type,
                guaranteed_gpus=q.guaranteed_gpus,
                borrow_limit=q.borrow_limit,
                weight=q.weight,
            )
            for q in team.quotas
        ],
    )


def node_to_proto(node: NodeRow) -> scheduler_pb2.Node:
    gpus = [
        common_pb2.Gpu(index=int(g["index"]), type=str(g["type"]), memory_mb=int(g["memory_mb"]))
        for g in node.gpus
    ]
    return scheduler_pb2.Node(
        node_id=node.node_id,
        name=node.name,
        gpus=gpus,
        topology=scheduler_pb2.NodeTopology(
            node_group=node.node_group, rack=node.rack, nvlink_domain=node.nvlink_domain
        ),
        labels=dict(node.labels),
        state=node.state,  # type: ignore[arg-type]
        last_heartbeat_at=_ts(node.last_heartbeat_at),
        running_job_ids=list(node.running_job_ids),
    )


def stats_to_proto(s: QueueStats) -> scheduler_pb2.TeamQueueStats:
    return scheduler_pb2.TeamQueueStats(
        team=s.team,
        pending_jobs=s.pending_jobs,
        running_jobs=s.running_jobs,
        gpus_in_use=s.gpus_in_use,
        queue_time_p50_seconds=s.queue_time_p50_s,
        queue_time_p95_seconds=s.queue_time_p95_s,
    )


class SchedulerApi(scheduler_pb2_grpc.SchedulerServiceServicer):
    """Translates SchedulerService RPCs to :class:`SchedulerService` calls."""

    def __init__(self, service: SchedulerService, *, heartbeat_interval_s: int, max_page_size: int) -> None:
        self._service = service
        self._heartbeat_interval_s = heartbeat_interval_s
        self._max_page_size = max_page_size

    async def SubmitJob(
        self, request: scheduler_pb2.SubmitJobRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SubmitJobResponse:
        if not request.HasField("spec"):
            raise errors.ValidationError("spec", "is required")
        job = await self._service.submit_job(request.spec, request.request_id)
        return scheduler_pb2.SubmitJobResponse(job=job_to_proto(job))

    async def GetJob(
        self, request: scheduler_pb2.GetJobRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.GetJobResponse:
        return scheduler_pb2.GetJobResponse(job=job_to_proto(await self._service.get_job(request.job_id)))

    async def ListJobs(
        self, request: scheduler_pb2.ListJobsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ListJobsResponse:
        size, offset = decode_page(request.page, max_size=self._max_page_size)
        jobs, total = await self._service.list_jobs(request.team, request.states, size, offset)
        return scheduler_pb2.ListJobsResponse(
            jobs=[job_to_proto(j) for j in jobs], page=page_info(offset, len(jobs), total)
        )

    async def CancelJob(
        self, request: scheduler_pb2.CancelJobRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.CancelJobResponse:
        return scheduler_pb2.CancelJobResponse(
            job=job_to_proto(await self._service.cancel_job(request.job_id, request.reason))
        )

    async def WatchJobs(
        self, request: scheduler_pb2.WatchJobsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.WatchJobsResponse]:
        async for job in self._service.watch(request.team, request.job_ids, request.send_initial):
            yield scheduler_pb2.WatchJobsResponse(job=job_to_proto(job))

    async def CreateTeam(
        self, request: scheduler_pb2.CreateTeamRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.CreateTeamResponse:
        team = await self._service.create_team(request.name, request.display_name, request.quotas)
        return scheduler_pb2.CreateTeamResponse(team=team_to_proto(team))

    async def GetTeam(
        self, request: scheduler_pb2.GetTeamRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.GetTeamResponse:
        return scheduler_pb2.GetTeamResponse(team=team_to_proto(await self._service.get_team(request.name)))

    async def ListTeams(
        self, request: scheduler_pb2.ListTeamsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ListTeamsResponse:
        size, offset = decode_page(request.page, max_size=self._max_page_size)
        teams, total = await self._service.list_teams(size, offset)
        return scheduler_pb2.ListTeamsResponse(
            teams=[team_to_proto(t) for t in teams], page=page_info(offset, len(teams), total)
        )

    async def SetQuota(
        self, request: scheduler_pb2.SetQuotaRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SetQuotaResponse:
        if not request.HasField("quota"):
            raise errors.ValidationError("quota", "is required")
        return scheduler_pb2.SetQuotaResponse(
            team=team_to_proto(await self._service.set_quota(request.team, request.quota))
        )

    async def GetQueueStats(
        self, request: scheduler_pb2.GetQueueStatsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.GetQueueStatsResponse:
        stats = await self._service.queue_stats(request.team)
        return scheduler_pb2.GetQueueStatsResponse(teams=[stats_to_proto(s) for s in stats])

    async def ListNodes(
        self, request: scheduler_pb2.ListNodesRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ListNodesResponse:
        size, offset = decode_page(request.page, max_size=self._max_page_size)
        nodes, total = await self._service.list_nodes(size, offset)
        return scheduler_pb2.ListNodesResponse(
            nodes=[node_to_proto(n) for n in nodes], page=page_info(offset, len(nodes), total)
        )

    async def AgentSession(
        self,
        request_iterator: AsyncIterator[scheduler_pb2.AgentSessionRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[scheduler_pb2.AgentSessionResponse]:
        """1. Read RegisterNode; 2. acknowledge with the node id; 3. apply heartbeats and job
        updates until the agent hangs up; 4. mark the node lost."""
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("message") != "register_node":
            raise errors.ValidationError(
                "register_node", "the first message of a session must be register_node"
            )
        node = await self._service.register_node(first.register_node)
        log.info("agent.registered", node=node.name, node_id=node.node_id, gpus=len(node.gpus))
        yield scheduler_pb2.AgentSessionResponse(
            register_ack=scheduler_pb2.RegisterAck(
                node_id=node.node_id, heartbeat_interval_seconds=self._heartbeat_interval_s
            )
        )
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("message")
                if kind == "heartbeat":
                    await self._service.heartbeat(node.name, message.heartbeat.running_job_ids)
                elif kind == "job_status_update":
                    await self._service.update_job_status(node.name, message.job_status_update)
                else:
                    raise errors.ValidationError("message", f"{kind} is only valid as the first message")
        except asyncio.CancelledError:
            raise
        finally:
            await asyncio.shield(self._service.mark_node_lost(node.name))
            log.info("agent.disconnected", node=node.name)
