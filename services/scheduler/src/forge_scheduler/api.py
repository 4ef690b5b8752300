"""gRPC servicer of ``forge.scheduler.v1.SchedulerService``: translation only.

Every translation between gRPC messages and the domain's values lives here: jobs, teams, nodes
and figures out; quotas, node registrations and replica reports in; agent commands out.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import AsyncIterator

import grpc
import structlog
from forge.common.v1 import common_pb2
from forge.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from google.protobuf import json_format, timestamp_pb2

from forge_kit import errors
from forge_kit.grpckit import SERVICE_PRINCIPAL, current_principal, require_admin
from forge_kit.paging import decode_page, page_info
from forge_scheduler.commands import AgentCommand, CancelJob, PreemptJob, StartJob
from forge_scheduler.messages import spec_from_proto, spec_to_proto
from forge_scheduler.records import (
    ClusterView,
    GpuInfo,
    NodeRegistration,
    QueueStats,
    QuotaSpec,
    ReplicaReport,
    TeamView,
)
from forge_scheduler.service import SchedulerService
from forge_scheduler.states import PENDING
from forge_scheduler.store import JobRow, NodeRow

log = structlog.get_logger(__name__)


def _ts(value: dt.datetime | None) -> timestamp_pb2.Timestamp | None:
    if value is None:
        return None
    stamp = timestamp_pb2.Timestamp()
    stamp.FromDatetime(value.replace(tzinfo=dt.UTC))
    return stamp


def job_to_proto(job: JobRow, queue_position: int = 0) -> scheduler_pb2.Job:
    pending = job.state == PENDING
    return scheduler_pb2.Job(
        id=job.id,
        spec=spec_to_proto(job.job_spec),
        state=job.state,  # type: ignore[arg-type]
        created_at=_ts(job.created_at),
        started_at=_ts(job.started_at),
        finished_at=_ts(job.finished_at),
        assigned_nodes=list(job.assigned_nodes),
        message=job.message,
        preemption_count=job.preemption_count,
        queue_position=queue_position if pending else 0,
        estimated_start=_ts(job.estimated_start) if pending else None,
        attempt=job.attempt or 0,
        pending_reason=(job.pending_reason or "") if pending else "",
        endpoints=[
            (job.endpoints or {})[node] for node, _ in (job.slots or []) if (job.endpoints or {}).get(node)
        ],
    )


def team_to_proto(team: TeamView) -> scheduler_pb2.Team:
    return scheduler_pb2.Team(
        name=team.name,
        display_name=team.display_name,
        created_at=_ts(team.created_at),
        cohort=team.cohort,
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


def node_to_proto(node: NodeRow, used: set[int] | None = None) -> scheduler_pb2.Node:
    gpus = [
        common_pb2.Gpu(
            index=int(g["index"]),
            type=str(g["type"]),
            memory_mb=int(g["memory_mb"]),
            # Rows registered before the agents reported their topology lack these.
            uuid=str(g.get("uuid", "")),
            pci_bus_id=str(g.get("pci_bus_id", "")),
            nvlink_group=int(g.get("nvlink_group", 0)),
            pcie_group=int(g.get("pcie_group", 0)),
        )
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
        free_gpus=sum(1 for g in gpus if g.index not in (used or set())),
        job_isolation=json_format.ParseDict(node.job_isolation, scheduler_pb2.JobIsolation())
        if node.job_isolation is not None
        else None,
    )


def stats_to_proto(s: QueueStats) -> scheduler_pb2.TeamQueueStats:
    return scheduler_pb2.TeamQueueStats(
        team=s.team,
        pending_jobs=s.pending_jobs,
        running_jobs=s.running_jobs,
        gpus_in_use=s.gpus_in_use,
        queue_time_p50_seconds=s.queue_time_p50_s,
        queue_time_p95_seconds=s.queue_time_p95_s,
        guaranteed_gpus=s.guaranteed_gpus,
        borrowed_gpus=s.borrowed_gpus,
        fair_share_gpus=s.fair_share_gpus,
        share_ratio=s.share_ratio,
        decayed_usage_gpu_hours=s.decayed_usage_gpu_hours,
    )


def cluster_to_proto(c: ClusterView) -> scheduler_pb2.GetClusterStatsResponse:
    return scheduler_pb2.GetClusterStatsResponse(
        total_gpus=c.total_gpus,
        allocated_gpus=c.allocated_gpus,
        utilization=c.utilization,
        fragmented_gpus=c.fragmented_gpus,
        jain_index=c.jain_index,
        share_deviation_gpus=c.share_deviation_gpus,
        ready_nodes=c.ready_nodes,
        pending_jobs=c.pending_jobs,
        running_jobs=c.running_jobs,
        largest_free_block=c.largest_free_block,
        last_cycle_ms=c.last_cycle_ms,
        last_cycle_at=_ts(c.last_cycle_at),
    )


def quota_from_proto(quota: scheduler_pb2.Quota) -> QuotaSpec:
    return QuotaSpec(quota.gpu_type, quota.guaranteed_gpus, quota.borrow_limit, quota.weight)


def registration_from_proto(request: scheduler_pb2.RegisterNode) -> NodeRegistration:
    return NodeRegistration(
        node_name=request.node_name,
        gpus=tuple(
            GpuInfo(g.index, g.type, g.memory_mb, g.uuid, g.pci_bus_id, g.nvlink_group, g.pcie_group)
            for g in request.gpus
        ),
        node_group=request.topology.node_group,
        rack=request.topology.rack,
        nvlink_domain=request.topology.nvlink_domain,
        labels=dict(request.labels),
        running_job_ids=tuple(request.running_job_ids),
        job_isolation=json_format.MessageToDict(request.job_isolation)
        if request.HasField("job_isolation")
        else None,
    )


def report_from_proto(update: scheduler_pb2.JobStatusUpdate) -> ReplicaReport:
    return ReplicaReport(
        job_id=update.job_id,
        state=update.state,
        message=update.message,
        endpoint=update.endpoint,
        last_checkpoint_at=update.last_checkpoint_at.ToDatetime()
        if update.HasField("last_checkpoint_at")
        else None,
    )


def command_to_proto(command: AgentCommand) -> scheduler_pb2.AgentSessionResponse:
    """The message an agent session sends for a domain command."""
    if isinstance(command, StartJob):
        return scheduler_pb2.AgentSessionResponse(
            start_job=scheduler_pb2.StartJob(
                job=job_to_proto(command.job),
                gpu_indices=list(command.gpu_indices),
                node_rank=command.node_rank,
                num_nodes=command.num_nodes,
                master_addr=command.master_addr,
                master_port=command.master_port,
                attempt=command.attempt,
                submitted_by_admin=command.submitted_by_admin,
            )
        )
    if isinstance(command, PreemptJob):
        return scheduler_pb2.AgentSessionResponse(
            preempt_job=scheduler_pb2.PreemptJob(
                job_id=command.job_id, reason=command.reason, grace_seconds=command.grace_seconds
            )
        )
    if isinstance(command, CancelJob):
        return scheduler_pb2.AgentSessionResponse(
            cancel_job=scheduler_pb2.CancelJob(job_id=command.job_id, reason=command.reason)
        )
    raise TypeError(f"unknown agent command {command!r}")


class SchedulerApi(scheduler_pb2_grpc.SchedulerServiceServicer):
    """Translates SchedulerService RPCs to :class:`SchedulerService` calls."""

    def __init__(self, service: SchedulerService, *, heartbeat_interval_s: int, max_page_size: int) -> None:
        self._service = service
        self._heartbeat_interval_s = heartbeat_interval_s
        self._max_page_size = max_page_size

    def _job(self, job: JobRow) -> scheduler_pb2.Job:
        return job_to_proto(job, self._service.cluster.queue_positions.get(job.id, 0))

    async def IssueTeamToken(
        self, request: scheduler_pb2.IssueTeamTokenRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.IssueTeamTokenResponse:
        token, token_id = await self._service.teams.issue_team_token(request.team, request.description)
        return scheduler_pb2.IssueTeamTokenResponse(token=token, token_id=token_id)

    async def GetCaller(
        self, request: scheduler_pb2.GetCallerRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.GetCallerResponse:
        principal = current_principal() or SERVICE_PRINCIPAL  # auth off: every caller is an admin
        return scheduler_pb2.GetCallerResponse(name=principal.name, role=principal.role, team=principal.team)

    async def GetClusterStats(
        self, request: scheduler_pb2.GetClusterStatsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.GetClusterStatsResponse:
        return cluster_to_proto(self._service.cluster)

    async def SubmitJob(
        self, request: scheduler_pb2.SubmitJobRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SubmitJobResponse:
        if not request.HasField("spec"):
            raise errors.ValidationError("spec", "is required")
        job = await self._service.submit_job(
            spec_from_proto(request.spec), request.request_id, on_behalf_of=request.on_behalf_of
        )
        return scheduler_pb2.SubmitJobResponse(job=self._job(job))

    async def GetJob(
        self, request: scheduler_pb2.GetJobRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.GetJobResponse:
        return scheduler_pb2.GetJobResponse(job=self._job(await self._service.get_job(request.job_id)))

    async def ListJobs(
        self, request: scheduler_pb2.ListJobsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ListJobsResponse:
        size, offset = decode_page(request.page, max_size=self._max_page_size)
        jobs, total = await self._service.list_jobs(request.team, request.states, size, offset)
        return scheduler_pb2.ListJobsResponse(
            jobs=[self._job(j) for j in jobs], page=page_info(offset, len(jobs), total)
        )

    async def CancelJob(
        self, request: scheduler_pb2.CancelJobRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.CancelJobResponse:
        return scheduler_pb2.CancelJobResponse(
            job=self._job(await self._service.cancel_job(request.job_id, request.reason))
        )

    async def WatchJobs(
        self, request: scheduler_pb2.WatchJobsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.WatchJobsResponse]:
        async for job in self._service.watches.watch(request.team, request.job_ids, request.send_initial):
            yield scheduler_pb2.WatchJobsResponse(job=self._job(job))

    async def CreateTeam(
        self, request: scheduler_pb2.CreateTeamRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.CreateTeamResponse:
        team = await self._service.teams.create_team(
            request.name, request.display_name, [quota_from_proto(q) for q in request.quotas], request.cohort
        )
        return scheduler_pb2.CreateTeamResponse(team=team_to_proto(team))

    async def GetTeam(
        self, request: scheduler_pb2.GetTeamRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.GetTeamResponse:
        return scheduler_pb2.GetTeamResponse(
            team=team_to_proto(await self._service.teams.get_team(request.name))
        )

    async def ListTeams(
        self, request: scheduler_pb2.ListTeamsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ListTeamsResponse:
        size, offset = decode_page(request.page, max_size=self._max_page_size)
        teams, total = await self._service.teams.list_teams(size, offset)
        return scheduler_pb2.ListTeamsResponse(
            teams=[team_to_proto(t) for t in teams], page=page_info(offset, len(teams), total)
        )

    async def SetQuota(
        self, request: scheduler_pb2.SetQuotaRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SetQuotaResponse:
        if not request.HasField("quota"):
            raise errors.ValidationError("quota", "is required")
        return scheduler_pb2.SetQuotaResponse(
            team=team_to_proto(
                await self._service.teams.set_quota(request.team, quota_from_proto(request.quota))
            )
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
        nodes, total = await self._service.nodes.list_nodes(size, offset)
        used = await self._service.nodes.used_gpus()
        return scheduler_pb2.ListNodesResponse(
            nodes=[node_to_proto(n, used.get(n.name)) for n in nodes],
            page=page_info(offset, len(nodes), total),
        )

    async def AgentSession(
        self,
        request_iterator: AsyncIterator[scheduler_pb2.AgentSessionRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[scheduler_pb2.AgentSessionResponse]:
        """1. Read RegisterNode (only the service token may register nodes); 2. acknowledge with
        the node id, re-send StartJob commands the node missed and cancel the replicas it still
        runs that the scheduler gave up on (``stale_runs``); 3. until the agent hangs up, apply its
        heartbeats (each checked for stale replicas too) and job reports while forwarding the
        scheduler's commands; 4. mark the node NOT_READY (the scheduling loop requeues its jobs if
        it stays away)."""
        require_admin("AgentSession")
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("message") != "register_node":
            raise errors.ValidationError(
                "register_node", "the first message of a session must be register_node"
            )
        node = await self._service.nodes.register_node(registration_from_proto(first.register_node))
        log.info("agent.registered", node=node.name, node_id=node.node_id, gpus=len(node.gpus))
        commands = self._service.hub.open(node.name)
        told: set[str] = set()  # stale replicas this session already told to stop
        reader = asyncio.create_task(self._read_agent(node.name, request_iterator, told))
        try:
            yield scheduler_pb2.AgentSessionResponse(
                register_ack=scheduler_pb2.RegisterAck(
                    node_id=node.node_id, heartbeat_interval_seconds=self._heartbeat_interval_s
                )
            )
            running = first.register_node.running_job_ids
            for command in await self._service.nodes.outstanding_starts(node.name, running):
                yield command_to_proto(command)
            for cancel in await self._service.nodes.stale_runs(node.name, running):
                told.add(cancel.job_id)
                log.warning("agent.stale_replica", node=node.name, job_id=cancel.job_id)
                yield command_to_proto(cancel)
            while True:
                next_command = asyncio.ensure_future(commands.get())
                done, _ = await asyncio.wait({next_command, reader}, return_when=asyncio.FIRST_COMPLETED)
                if next_command in done:
                    yield command_to_proto(next_command.result())
                    continue
                next_command.cancel()
                reader.result()  # the agent hung up (or broke the protocol: raises)
                return
        finally:
            reader.cancel()
            self._service.hub.close(node.name, commands)
            await asyncio.shield(self._service.nodes.mark_node_lost(node.name))
            log.info("agent.disconnected", node=node.name)

    async def _read_agent(
        self,
        node_name: str,
        request_iterator: AsyncIterator[scheduler_pb2.AgentSessionRequest],
        told: set[str],
    ) -> None:
        async for message in request_iterator:
            kind = message.WhichOneof("message")
            if kind == "heartbeat":
                running = message.heartbeat.running_job_ids
                await self._service.nodes.heartbeat(node_name, running)
                # A session that outlived a loss timeout (a partition that healed without
                # breaking the connection) still runs what the scheduler requeued meanwhile.
                for cancel in await self._service.nodes.stale_runs(node_name, set(running) - told):
                    told.add(cancel.job_id)
                    log.warning("agent.stale_replica", node=node_name, job_id=cancel.job_id)
                    self._service.hub.send(node_name, cancel)
            elif kind == "job_status_update":
                await self._service.update_job_status(node_name, report_from_proto(message.job_status_update))
            else:
                raise errors.ValidationError("message", f"{kind} is only valid as the first message")
