"""A trainer agent cut off from the scheduler mid-job for longer than the node-loss timeout, then
healed (``agent_partition``: the held connections reset at the heal, as TCP gives up on a long
partition; ``agent_partition_held``: the same connection carries on once the link is back).

Platform: Tansu, Temporal, the scheduler (a node silent 4 s is lost, heartbeats every 1 s) and
two trainer agents (two simulated GPUs each), each dialling the scheduler through a fault proxy of
its own. A client submits two one-GPU jobs that sleep ``JOB_S`` seconds; once both run, the link
of the first job's node is partitioned (both ways) past the loss timeout: the scheduler gives the
node up and requeues its jobs onto the other node, while the cut-off agent, hearing nothing, runs
them on. After the heal:

* each job is once in the scheduler and ends SUCCEEDED; its terminal state is one (the scheduler's
  own outbox of ``JobStateChanged`` events: never two fates);
* no job ran to success twice (the agents' run tables): the agent stopped every attempt the
  scheduler gave up on (it ends CANCELLED, before the job's own end);
* recovery: from the heal until the cut-off node's stale attempts were stopped, and until every
  job ended. Printed too: how long the two attempts of a job ran side by side (the partition's
  blind spot: the cut-off agent cannot know it was given up on until it hears back).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import sqlite3
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from fault_platform import SCHEDULER_TOKEN, Platform, agent_process, start_platform, stop_platform, wait_ready
from faultkit.history import History, check_jobs, verdict
from faultkit.scenario import Targets, load_scenario, run_timeline
from forge.common.v1 import common_pb2
from forge.events.v1 import events_pb2
from forge.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

from forge_kit.grpckit import make_channel
from forge_kit.testing import ServiceProcess
from forge_kit.testing.fault_proxy import FaultProxy

pytestmark = [pytest.mark.integration, pytest.mark.faults_full, pytest.mark.timeout(420)]
NODES = ("node-a", "node-b")
JOBS = 2
JOB_S = 30.0  # long enough that a stale attempt left alone would end SUCCEEDED after the heal
LOST_AFTER_S = 4
SUCCEEDED = common_pb2.JOB_STATE_SUCCEEDED
CANCELLED = common_pb2.JOB_STATE_CANCELLED
TERMINAL = {common_pb2.JOB_STATE_SUCCEEDED, common_pb2.JOB_STATE_FAILED, common_pb2.JOB_STATE_CANCELLED}


@dataclass
class Rig:
    platform: Platform
    agents: dict[str, ServiceProcess]
    links: dict[str, FaultProxy]


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    platform = start_platform(
        tmp_path_factory.mktemp("agent-partition"),
        scheduler_env={
            "FORGE_SCHEDULER_NODE_LOST_AFTER_S": str(LOST_AFTER_S),
            "FORGE_SCHEDULER_HEARTBEAT_INTERVAL_S": "1",
        },
    )
    host, port = platform.scheduler.grpc_target.rsplit(":", 1)
    links: dict[str, FaultProxy] = {}
    agents: dict[str, ServiceProcess] = {}
    try:
        for name in NODES:
            links[name] = FaultProxy((host, int(port)), name=name).start()
            agent = agent_process(platform, name, gpus="SIMx2")
            agent.env["FORGE_TRAINER_AGENT_SCHEDULER_TARGET"] = links[name].address
            agents[name] = agent.start()
        for agent in agents.values():
            wait_ready(agent)
        yield Rig(platform, agents, links)
    finally:
        for agent in agents.values():
            agent.stop()
        for link in links.values():
            link.stop()
        stop_platform(platform)


def agent_runs(rig: Rig) -> dict[str, list[tuple[str, int, int, dt.datetime | None, dt.datetime | None]]]:
    """job id → (node, attempt, state, started_at, finished_at) of every run, from the agents' tables."""
    runs: dict[str, list[tuple[str, int, int, dt.datetime | None, dt.datetime | None]]] = defaultdict(list)
    for name in NODES:
        (database,) = (rig.platform.root / name).glob("*.db")
        with sqlite3.connect(database) as conn:
            rows = conn.execute("SELECT job_id, attempt, state, started_at, finished_at FROM runs").fetchall()
        for job_id, attempt, state, started, finished in rows:
            stamp = [dt.datetime.fromisoformat(str(s)) if s else None for s in (started, finished)]
            runs[str(job_id)].append((name, int(attempt), int(state), stamp[0], stamp[1]))
    return runs


def published_states(rig: Rig) -> dict[str, list[str]]:
    """job id → every state the scheduler announced it in (its outbox, the events' source)."""
    states: dict[str, list[str]] = defaultdict(list)
    with sqlite3.connect(rig.platform.root / "scheduler" / "scheduler.db") as conn:
        rows = conn.execute("SELECT payload FROM forge_outbox WHERE event_type LIKE '%JobStateChanged'")
        for (payload,) in rows:
            event = events_pb2.JobStateChanged.FromString(payload)
            states[event.job_id].append(common_pb2.JobState.Name(event.state).removeprefix("JOB_STATE_"))
    return states


async def play(rig: Rig, name: str) -> None:
    scenario = load_scenario(name)
    team = f"part-{uuid.uuid4().hex[:6]}"
    history = History()
    async with make_channel(rig.platform.scheduler.grpc_target, token=SCHEDULER_TOKEN) as channel:
        scheduler = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        quota = scheduler_pb2.Quota(gpu_type="SIM", guaranteed_gpus=4)
        await scheduler.CreateTeam(scheduler_pb2.CreateTeamRequest(name=team, quotas=[quota]), timeout=30)

        async def get(job_id: str) -> scheduler_pb2.Job:
            return (await scheduler.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id), timeout=30)).job

        # 1. The jobs, each submitted once (request ids make a retried submit the same job).
        jobs: list[str] = []
        for i in range(JOBS):
            spec = scheduler_pb2.JobSpec(
                name=f"sleep-{i}",
                team=team,
                priority_class="normal",
                command=[sys.executable, "-c", f"import time; time.sleep({JOB_S})"],
                resources=common_pb2.ResourceRequest(gpu_count=1, gpu_type="SIM"),
                replicas=1,
            )
            op = history.invoke("client", "submit", f"{team}-{i}")
            reply = await scheduler.SubmitJob(
                scheduler_pb2.SubmitJobRequest(spec=spec, request_id=f"{team}-{i}"), timeout=30
            )
            jobs.append(reply.job.id)
            history.ok(op, reply.job.id)
        deadline = time.monotonic() + 120
        while [j for j in jobs if (await get(j)).state != common_pb2.JOB_STATE_RUNNING]:
            assert time.monotonic() < deadline, "the jobs did not start"
            await asyncio.sleep(0.2)
        placed = {j: list((await get(j)).assigned_nodes) for j in jobs}
        victim = placed[jobs[0]][0]
        survivor = next(n for n in NODES if n != victim)
        stranded = [j for j in jobs if placed[j] == [victim]]

        # 2. The victim's link partitioned past the loss timeout, then healed.
        await run_timeline(scenario, Targets(links={"agent_link": rig.links[victim]}))
        healed = time.monotonic()
        healed_at = dt.datetime.now(dt.UTC).replace(tzinfo=None)

        # 3. Every job ends; the stale attempts on the victim are stopped.
        ended: dict[str, scheduler_pb2.Job] = {}
        deadline = time.monotonic() + 180
        while len(ended) < len(jobs):
            for j in jobs:
                job = await get(j)
                if job.state in TERMINAL:
                    ended[j] = job
            assert time.monotonic() < deadline, f"jobs still running: {set(jobs) - set(ended)}"
            await asyncio.sleep(0.5)
        recovery = time.monotonic() - healed

    runs = agent_runs(rig)
    for job_id in jobs:  # the scheduler's final word on each job
        history.ok(history.invoke("scheduler", "fate", job_id), common_pb2.JobState.Name(ended[job_id].state))
    history.dump(rig.platform.root / f"{name}.history.jsonl")
    # Keyed as the client knows them (its request ids), so an anomaly names the submit operation.
    keys = {job_id: op.key for op in history.of("submit") if op.type == "ok" for job_id in [op.value]}
    successes = {keys[j]: [node for node, _, state, _, _ in runs[j] if state == SUCCEEDED] for j in jobs}
    states = published_states(rig)
    result = verdict(
        history, check_jobs(history, "submit", {keys[j]: states.get(j, []) for j in jobs}, successes)
    )
    stale = [r for j in stranded for r in runs[j] if r[0] == victim]
    stopped_after = max(((r[4] or healed_at) - healed_at).total_seconds() for r in stale)
    side_by_side = 0.0
    for j in stranded:
        first = next(r for r in runs[j] if r[0] == victim)
        second = next((r for r in runs[j] if r[0] == survivor), None)
        if second is not None and second[3] and first[4]:
            side_by_side = max(side_by_side, (first[4] - second[3]).total_seconds())
    print(
        f"\nfault {name}: {len(jobs)} jobs ({len(stranded)} on the cut-off {victim}), "
        f"{result.ops_checked} operations checked, anomalies {len(result.anomalies)}; "
        f"stale attempts stopped {stopped_after:.1f}s after the heal, every job ended "
        f"{recovery:.1f}s after it; the two attempts of a job ran side by side for {side_by_side:.1f}s"
    )
    result.assert_valid()
    assert all(job.state == SUCCEEDED for job in ended.values()), {j: job.message for j, job in ended.items()}
    for j in stranded:  # given up on, requeued, run on the other node
        assert ended[j].attempt == 2 and list(ended[j].assigned_nodes) == [survivor], ended[j]
    assert stale and all(r[2] == CANCELLED for r in stale), f"attempts left on {victim}: {stale}"


@pytest.mark.asyncio
async def test_agent_partitioned_past_the_loss_timeout_is_stopped_and_the_job_runs_once(rig: Rig) -> None:
    await play(rig, "agent_partition")


@pytest.mark.asyncio
async def test_agent_partition_on_a_held_connection(rig: Rig) -> None:
    await play(rig, "agent_partition_held")
