"""``forge jobs …``: submit, list, inspect and cancel jobs; manage teams and team tokens;
``forge queue``: pending jobs with their reasons and estimated starts, and per-team queue figures;
``forge cluster``: utilisation, fragmentation, fairness and nodes.

Target: ``--target`` / ``$FORGE_CLI_SCHEDULER_TARGET`` (default ``127.0.0.1:50051``); token:
the file ``--token-file`` names / ``$FORGE_CLI_SCHEDULER_TOKEN``, else ``var/secrets/tokens.json`` (see
:mod:`forge_kit.clitools`).
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any

import grpc
import typer
from forge.common.v1 import common_pb2
from forge.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from google.protobuf import json_format

from forge_kit import clitools
from forge_kit.grpckit import make_channel
from forge_kit.jobstate import JobState

app = typer.Typer(help="Submit and manage jobs, teams and quotas on the scheduler.", no_args_is_help=True)
RPC_TIMEOUT_S = 15.0

TargetOption = Annotated[
    str, typer.Option("--target", envvar="FORGE_CLI_SCHEDULER_TARGET", help="Scheduler gRPC host:port.")
]
TokenOption = Annotated[str, clitools.token_option("FORGE_CLI_SCHEDULER_TOKEN", "scheduler token")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def _stub(target: str, token: str) -> tuple[grpc.aio.Channel, scheduler_pb2_grpc.SchedulerServiceAsyncStub]:
    channel = make_channel(target, token=clitools.resolve_token("scheduler", token))
    return channel, scheduler_pb2_grpc.SchedulerServiceStub(channel)


def _job_row(job: scheduler_pb2.Job) -> dict[str, Any]:
    return {
        "id": job.id,
        "name": job.spec.name,
        "team": job.spec.team,
        "priority": job.spec.priority_class,
        "gpus": f"{max(1, job.spec.replicas)}x{job.spec.resources.gpu_count} {job.spec.resources.gpu_type}".strip(),
        "state": JobState.from_proto(job.state).value,
        "message": job.message,
    }


@app.command()
def submit(
    name: Annotated[str, typer.Argument(help="Job name (lowercase letters, digits, '-').")],
    command: Annotated[list[str], typer.Argument(help="Command line to run.")],
    team: Annotated[str, typer.Option("--team", help="Owning team.")] = "default",
    priority: Annotated[
        str, typer.Option("--priority", help="production, high, normal or preemptible.")
    ] = "normal",
    gpus: Annotated[int, typer.Option("--gpus", help="GPUs per replica.")] = 0,
    gpu_type: Annotated[str, typer.Option("--gpu-type", help="GPU type, e.g. H100.")] = "",
    replicas: Annotated[int, typer.Option("--replicas", help="Gang size.")] = 1,
    placement: Annotated[str, typer.Option("--placement", help="any, same-node or same-node-group.")] = "any",
    min_runtime: Annotated[
        int, typer.Option("--min-runtime", min=0, help="Seconds before the job may be preempted.")
    ] = 0,
    checkpointable: Annotated[
        bool, typer.Option("--checkpointable", help="The job checkpoints and resumes.")
    ] = False,
    target: TargetOption = "127.0.0.1:50051",
    token: TokenOption = "",
    as_json: JsonOption = False,
) -> None:
    """Submit a job and print it."""
    placements = {
        "any": scheduler_pb2.PLACEMENT_ANY,
        "same-node": scheduler_pb2.PLACEMENT_SAME_NODE,
        "same-node-group": scheduler_pb2.PLACEMENT_SAME_NODE_GROUP,
    }
    if placement not in placements:
        raise typer.BadParameter(f"must be one of {', '.join(placements)}", param_hint="--placement")
    spec = scheduler_pb2.JobSpec(
        name=name,
        team=team,
        priority_class=priority,
        command=command,
        replicas=replicas,
        resources=common_pb2.ResourceRequest(gpu_count=gpus, gpu_type=gpu_type),
        placement=placements[placement],
        min_runtime_seconds=min_runtime,
        checkpointable=checkpointable,
    )

    async def go() -> scheduler_pb2.Job:
        channel, stub = _stub(target, token)
        async with channel:
            request = scheduler_pb2.SubmitJobRequest(spec=spec, request_id=str(uuid.uuid4()))
            return (await stub.SubmitJob(request, timeout=RPC_TIMEOUT_S)).job

    clitools.show_record(_job_row(clitools.run_rpc(go())), as_json)


@app.command("list")
def list_jobs(
    team: Annotated[str, typer.Option("--team", help="Only this team's jobs.")] = "",
    limit: Annotated[int, typer.Option("--limit", help="At most this many jobs.")] = 50,
    target: TargetOption = "127.0.0.1:50051",
    token: TokenOption = "",
    as_json: JsonOption = False,
) -> None:
    """List jobs, newest first."""

    async def go() -> list[scheduler_pb2.Job]:
        channel, stub = _stub(target, token)
        async with channel:
            request = scheduler_pb2.ListJobsRequest(team=team, page=common_pb2.PageRequest(page_size=limit))
            return list((await stub.ListJobs(request, timeout=RPC_TIMEOUT_S)).jobs)

    rows = [_job_row(job) for job in clitools.run_rpc(go())]
    clitools.show_rows(rows, ["id", "name", "team", "priority", "gpus", "state", "message"], as_json, "jobs")


@app.command()
def get(
    job_id: Annotated[str, typer.Argument(help="Job id.")],
    target: TargetOption = "127.0.0.1:50051",
    token: TokenOption = "",
) -> None:
    """Show one job in full (JSON)."""

    async def go() -> scheduler_pb2.Job:
        channel, stub = _stub(target, token)
        async with channel:
            return (await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id), timeout=RPC_TIMEOUT_S)).job

    clitools.show_record(json_format.MessageToDict(clitools.run_rpc(go())), as_json=True)


@app.command()
def cancel(
    job_id: Annotated[str, typer.Argument(help="Job id.")],
    reason: Annotated[str, typer.Option("--reason", help="Why; recorded on the job.")] = "",
    target: TargetOption = "127.0.0.1:50051",
    token: TokenOption = "",
    as_json: JsonOption = False,
) -> None:
    """Cancel a job (idempotent)."""

    async def go() -> scheduler_pb2.Job:
        channel, stub = _stub(target, token)
        async with channel:
            request = scheduler_pb2.CancelJobRequest(job_id=job_id, reason=reason)
            return (await stub.CancelJob(request, timeout=RPC_TIMEOUT_S)).job

    clitools.show_record(_job_row(clitools.run_rpc(go())), as_json)


@app.command("create-team")
def create_team(
    name: Annotated[str, typer.Argument(help="Team name.")],
    quota: Annotated[
        list[str], typer.Option("--quota", help="GPU quota as TYPE=GUARANTEED[:BORROW[:WEIGHT]], repeatable.")
    ] = [],  # noqa: B006 - typer reads the default, it is never mutated
    target: TargetOption = "127.0.0.1:50051",
    token: TokenOption = "",
    as_json: JsonOption = False,
) -> None:
    """Create a team with optional quotas."""
    quotas = [parse_quota(q) for q in quota]

    async def go() -> scheduler_pb2.Team:
        channel, stub = _stub(target, token)
        async with channel:
            request = scheduler_pb2.CreateTeamRequest(name=name, quotas=quotas)
            return (await stub.CreateTeam(request, timeout=RPC_TIMEOUT_S)).team

    clitools.show_record(json_format.MessageToDict(clitools.run_rpc(go())), as_json)


@app.command()
def stats(
    team: Annotated[str, typer.Option("--team", help="Only this team.")] = "",
    target: TargetOption = "127.0.0.1:50051",
    token: TokenOption = "",
    as_json: JsonOption = False,
) -> None:
    """Queue statistics by team: pending, running, GPUs in use, queue-time p50/p95."""

    async def go() -> list[scheduler_pb2.TeamQueueStats]:
        channel, stub = _stub(target, token)
        async with channel:
            reply = await stub.GetQueueStats(
                scheduler_pb2.GetQueueStatsRequest(team=team), timeout=RPC_TIMEOUT_S
            )
            return list(reply.teams)

    rows = [
        {
            "team": s.team,
            "pending": s.pending_jobs,
            "running": s.running_jobs,
            "gpus": s.gpus_in_use,
            "p50_s": round(s.queue_time_p50_seconds, 1),
            "p95_s": round(s.queue_time_p95_seconds, 1),
        }
        for s in clitools.run_rpc(go())
    ]
    clitools.show_rows(rows, ["team", "pending", "running", "gpus", "p50_s", "p95_s"], as_json, "queues")


def parse_quota(text: str) -> scheduler_pb2.Quota:
    """``H100=8:4:2`` → Quota(gpu_type=H100, guaranteed 8, borrow 4, weight 2)."""
    gpu_type, sep, numbers = text.partition("=")
    parts = numbers.split(":") if sep else []
    if not gpu_type or not 1 <= len(parts) <= 3:
        raise typer.BadParameter(f"{text!r} is not TYPE=GUARANTEED[:BORROW[:WEIGHT]]", param_hint="--quota")
    try:
        guaranteed = int(parts[0])
        borrow = int(parts[1]) if len(parts) > 1 else 0
        weight = float(parts[2]) if len(parts) > 2 else 1.0
    except ValueError:
        raise typer.BadParameter(f"{text!r} has a non-numeric part", param_hint="--quota") from None
    return scheduler_pb2.Quota(
        gpu_type=gpu_type, guaranteed_gpus=guaranteed, borrow_limit=borrow, weight=weight
    )


@app.command()
def token(
    team: Annotated[str, typer.Argument(help="Team the token acts for.")],
    description: Annotated[str, typer.Option("--description", help="What the token is for.")] = "",
    target: TargetOption = "127.0.0.1:50051",
    token: TokenOption = "",
) -> None:
    """Issue a team token (admin): it may submit and cancel only that team's jobs. Shown once."""

    async def go() -> scheduler_pb2.IssueTeamTokenResponse:
        channel, stub = _stub(target, token)
        async with channel:
            return await stub.IssueTeamToken(
                scheduler_pb2.IssueTeamTokenRequest(team=team, description=description), timeout=RPC_TIMEOUT_S
            )

    reply = clitools.run_rpc(go())
    typer.echo(f"token_id: {reply.token_id}")
    typer.echo(f"token: {reply.token}")


def _ts(stamp: Any) -> str:
    return stamp.ToDatetime().strftime("%Y-%m-%d %H:%M:%S") if stamp.seconds else ""


queue_app = typer.Typer(help="Pending jobs with why they wait, and queue figures by team.")


@queue_app.command("queue")
def queue(
    team: Annotated[str, typer.Option("--team", help="Only this team.")] = "",
    limit: Annotated[int, typer.Option("--limit", min=1, max=500, help="Pending jobs to show.")] = 50,
    target: TargetOption = "127.0.0.1:50051",
    token: TokenOption = "",
    as_json: JsonOption = False,
) -> None:
    """Pending jobs (position in team queue, reason in words, estimated start) and per-team
    queue time p50/p95, GPUs in use, guarantee, borrowed GPUs and fair share."""

    async def go() -> tuple[list[scheduler_pb2.Job], list[scheduler_pb2.TeamQueueStats]]:
        channel, stub = _stub(target, token)
        async with channel:
            jobs = await stub.ListJobs(
                scheduler_pb2.ListJobsRequest(
                    team=team,
                    states=[JobState.PENDING.proto],
                    page=common_pb2.PageRequest(page_size=limit),
                ),
                timeout=RPC_TIMEOUT_S,
            )
            stats = await stub.GetQueueStats(
                scheduler_pb2.GetQueueStatsRequest(team=team), timeout=RPC_TIMEOUT_S
            )
            return list(jobs.jobs), list(stats.teams)

    jobs, stats = clitools.run_rpc(go())
    pending = [
        {
            "id": j.id,
            "team": j.spec.team,
            "pos": j.queue_position,
            "priority": j.spec.priority_class,
            "gpus": f"{max(1, j.spec.replicas)}x{j.spec.resources.gpu_count}",
            "reason": j.pending_reason,
            "estimated_start": _ts(j.estimated_start),
        }
        for j in sorted(jobs, key=lambda j: (j.spec.team, j.queue_position or 1 << 30))
    ]
    teams = [
        {
            "team": s.team,
            "pending": s.pending_jobs,
            "running": s.running_jobs,
            "gpus": s.gpus_in_use,
            "guaranteed": s.guaranteed_gpus,
            "borrowed": s.borrowed_gpus,
            "fair_share": round(s.fair_share_gpus, 1),
            "share_ratio": round(s.share_ratio, 2),
            "p50_s": round(s.queue_time_p50_seconds, 1),
            "p95_s": round(s.queue_time_p95_seconds, 1),
        }
        for s in stats
    ]
    if as_json:
        typer.echo(json.dumps({"pending": pending, "teams": teams}, indent=2))
        return
    clitools.show_rows(
        pending, ["id", "team", "pos", "priority", "gpus", "reason", "estimated_start"], False, "pending"
    )
    clitools.show_rows(teams, list(teams[0]) if teams else ["team"], False, "teams")


cluster_app = typer.Typer(help="Cluster utilisation, fragmentation, fairness and nodes.")


@cluster_app.command("cluster")
def cluster(
    target: TargetOption = "127.0.0.1:50051",
    token: TokenOption = "",
    as_json: JsonOption = False,
) -> None:
    """Figures of the last scheduling cycle, every node with its free GPUs, and the serving
    replicas (running inference jobs) with the URL each serves on."""

    async def go() -> tuple[
        scheduler_pb2.GetClusterStatsResponse, list[scheduler_pb2.Node], list[scheduler_pb2.Job]
    ]:
        channel, stub = _stub(target, token)
        async with channel:
            stats = await stub.GetClusterStats(scheduler_pb2.GetClusterStatsRequest(), timeout=RPC_TIMEOUT_S)
            nodes = await stub.ListNodes(
                scheduler_pb2.ListNodesRequest(page=common_pb2.PageRequest(page_size=500)),
                timeout=RPC_TIMEOUT_S,
            )
            running = await stub.ListJobs(
                scheduler_pb2.ListJobsRequest(
                    states=[common_pb2.JOB_STATE_RUNNING], page=common_pb2.PageRequest(page_size=500)
                ),
                timeout=RPC_TIMEOUT_S,
            )
            return stats, list(nodes.nodes), list(running.jobs)

    stats, nodes, running = clitools.run_rpc(go())
    serving = [
        {
            "job": j.id,
            "deployment": j.spec.labels.get("deployment", ""),
            "team": j.spec.team,
            "node": ",".join(j.assigned_nodes),
            "gpus": f"{max(1, j.spec.replicas)}x{j.spec.resources.gpu_count}",
            "endpoint": ",".join(j.endpoints),
        }
        for j in running
        if j.spec.kind == scheduler_pb2.JOB_KIND_INFERENCE
    ]
    summary = json_format.MessageToDict(stats, always_print_fields_with_no_presence=True)
    rows = [
        {
            "node": n.name,
            "state": scheduler_pb2.NodeState.Name(n.state).removeprefix("NODE_STATE_"),
            "group": n.topology.node_group,
            "gpus": f"{len(n.gpus)}x{n.gpus[0].type}" if n.gpus else "0",
            "free": n.free_gpus,
            "jobs": ",".join(n.running_job_ids),
            "isolation": _isolation(n),
        }
        for n in nodes
    ]
    if as_json:
        typer.echo(json.dumps({"cluster": summary, "nodes": rows, "serving": serving}, indent=2))
        return
    clitools.show_record(summary, False)
    clitools.show_rows(rows, ["node", "state", "group", "gpus", "free", "jobs", "isolation"], False, "nodes")
    clitools.show_rows(
        serving, ["job", "deployment", "team", "node", "gpus", "endpoint"], False, "serving replicas"
    )


def _isolation(node: scheduler_pb2.Node) -> str:
    """How the node's agent contains jobs, in a few words (``unknown`` when it did not say)."""
    if not node.HasField("job_isolation"):
        return "unknown"
    iso = node.job_isolation
    if iso.isolated:
        return f"sandboxed (uid {iso.job_uid})"
    runs = "all jobs" if iso.allows_unisolated else "admin jobs only"
    return f"NONE, {runs}: {iso.detail}"
