"""The scheduler, its PostgreSQL, two trainer agents and the orchestrator under the scenarios of
``scenarios.yaml``, with every client operation in a history checked after the heal.

The scheduler reaches its PostgreSQL (a cluster of its own) through a fault proxy, the
``scheduler_db`` link. A client starts smoke workflows at a steady pace through the scenario (each
with an id of its own, so a retried start is the same workflow); each submits a job (``true``)
that one of the two agents runs, then cancels it if it is still queued. After the heal:

* every acknowledged start completed (``lost`` otherwise), and no retried start ran twice;
* the scheduler holds exactly the jobs the workflows reported, each once (no lost or extra job);
* each job's terminal state is one (never both SUCCEEDED and CANCELLED), and no job ran to
  success on two nodes or twice (the agents' own run tables);
* recovery: from the heal until every workflow completed.

``scheduler_db_partition``: 10 s, both ways, held connections reset at the heal.
``two_at_once``: the broker restarted (empty) in the middle of a 12 s scheduler ↔ database
partition. ``orchestrator_clock_ahead``: the orchestrator restarted with its wall clock 10 minutes
ahead (libfaketime); its durable timers (``hold_s``) must still take their time, and the rows it
writes carry its skewed clock (the proof the skew took).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import sqlite3
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from fault_platform import (
    ORCHESTRATOR_TOKEN,
    Platform,
    PrivatePostgres,
    agent_process,
    start_platform,
    stop_platform,
    wait_ready,
)
from faultkit.history import History, Verdict, check_copies, check_jobs, check_writes, verdict
from faultkit.host import faketime_library
from faultkit.scenario import Targets, clock_env, load_scenario, run_timeline
from forge.common.v1 import common_pb2
from forge.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from google.protobuf import json_format, struct_pb2

from forge_kit.events import ensure_topics
from forge_kit.grpckit import make_channel
from forge_kit.testing import ServiceProcess
from forge_kit.testing.fault_proxy import FaultProxy
from forge_kit.testing.requires import missing

pytestmark = [pytest.mark.integration, pytest.mark.faults_full, pytest.mark.timeout(420)]
PACE_S = 0.6
HOLD_S = 1.0
MIN_LOAD_S = 12.0  # workflows are started for the scenario's length, and at least this long
NODES = ("node-a", "node-b")


@dataclass
class Rig:
    platform: Platform
    postgres: PrivatePostgres
    link: FaultProxy
    agents: dict[str, ServiceProcess]


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    if not PrivatePostgres.available():
        missing("PostgreSQL's initdb/pg_ctl are not installed")
    root = Path(tmp_path_factory.mktemp("faults-partitions"))
    postgres = PrivatePostgres()
    link: FaultProxy | None = None
    platform: Platform | None = None
    agents: dict[str, ServiceProcess] = {}
    try:
        postgres.init()
        link = FaultProxy(("127.0.0.1", postgres.port), name="scheduler_db").start()
        url = postgres.create_database("scheduler").replace(f":{postgres.port}/", f":{link.port}/")
        platform = start_platform(root, scheduler_env={"FORGE_SCHEDULER_DATABASE_URL": url})
        agents = {name: agent_process(platform, name).start() for name in NODES}
        yield Rig(platform, postgres, link, agents)
    finally:
        for agent in agents.values():
            agent.stop()
        if platform is not None:
            stop_platform(platform)
        if link is not None:
            link.stop()
        postgres.remove()


async def start_workflows(rig: Rig, team: str, history: History, until: float) -> list[str]:
    """Start a smoke workflow every PACE_S until ``until`` (monotonic); a failed start is retried
    with the same id. Returns the ids."""
    keys: list[str] = []
    async with make_channel(rig.platform.orchestrator.grpc_target, token=ORCHESTRATOR_TOKEN) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        while time.monotonic() < until:
            key = f"{team}-{len(keys):03d}"
            keys.append(key)
            data = struct_pb2.Struct()
            data.update({"team": team, "hold_s": HOLD_S, "timeout_s": 180.0})
            while True:
                op = history.invoke("client", "start", key)
                sent = time.monotonic()
                try:
                    await stub.StartWorkflow(
                        orchestrator_pb2.StartWorkflowRequest(
                            workflow_type="smoke", input=data, workflow_id=key
                        ),
                        timeout=30,
                    )
                    history.ok(op, round(time.monotonic() - sent, 3))
                    break
                except grpc.aio.AioRpcError as exc:
                    outcome = (
                        history.info if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED else history.fail
                    )
                    outcome(op, f"{exc.code().name} {exc.details()}")
                    await asyncio.sleep(0.5)
            await asyncio.sleep(PACE_S)
    return keys


async def wait_all(
    rig: Rig, keys: list[str], timeout_s: float = 240
) -> dict[str, orchestrator_pb2.GetWorkflowResponse]:
    done: dict[str, orchestrator_pb2.GetWorkflowResponse] = {}
    deadline = time.monotonic() + timeout_s
    async with make_channel(rig.platform.orchestrator.grpc_target, token=ORCHESTRATOR_TOKEN) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        for key in keys:
            while True:
                try:
                    got = await stub.GetWorkflow(
                        orchestrator_pb2.GetWorkflowRequest(workflow_id=key), timeout=30
                    )
                    if got.status != orchestrator_pb2.WORKFLOW_STATUS_RUNNING:
                        done[key] = got
                        break
                except grpc.aio.AioRpcError as exc:
                    if exc.code() is grpc.StatusCode.NOT_FOUND:
                        break
                assert time.monotonic() < deadline, f"{key} still running after {timeout_s}s"
                await asyncio.sleep(0.5)
    return done


def agent_successes(rig: Rig, jobs: Collection[str]) -> dict[str, list[str]]:
    """job id → the nodes on which a run of it succeeded (the agents' own tables), for ``jobs``."""
    runs: dict[str, list[str]] = defaultdict(list)
    for name in NODES:
        (database,) = (rig.platform.root / name).glob("*.db")
        with sqlite3.connect(database) as conn:
            rows = conn.execute("SELECT job_id FROM runs WHERE state = ?", (common_pb2.JOB_STATE_SUCCEEDED,))
            for (job_id,) in rows:
                if str(job_id) in jobs:
                    runs[str(job_id)].append(name)
    return runs


def job_states(rig: Rig) -> dict[str, list[str]]:
    states: dict[str, list[str]] = defaultdict(list)
    with sqlite3.connect(rig.platform.root / "orchestrator" / "orchestrator.db") as conn:
        for job_id, state in conn.execute("SELECT job_id, state FROM job_events"):
            states[str(job_id)].append(str(state))
    return states


async def play(rig: Rig, name: str) -> tuple[Verdict, float, dict[str, orchestrator_pb2.GetWorkflowResponse]]:
    scenario = load_scenario(name)
    team = f"{name.replace('_', '-')[:12]}-{uuid.uuid4().hex[:4]}"
    history = History()

    def kill(target: str) -> None:
        assert target == "broker"
        rig.platform.broker.stop()

    def restart(target: str) -> None:
        rig.platform.broker.start()
        asyncio.run(ensure_topics(rig.platform.broker.bootstrap))

    targets = Targets(
        links={"scheduler_db": rig.link},
        processes={"broker": rig.platform.broker},
        kill=kill,
        restart=restart,
    )
    until = time.monotonic() + max(scenario.duration_s, MIN_LOAD_S) + 2
    starting = asyncio.create_task(start_workflows(rig, team, history, until))
    await run_timeline(scenario, targets)
    healed = time.monotonic()
    keys = await starting
    done = await wait_all(rig, keys)
    recovery = time.monotonic() - healed
    completed = {k: 1 for k, got in done.items() if got.status == orchestrator_pb2.WORKFLOW_STATUS_COMPLETED}
    reported = Counter(str(json_format.MessageToDict(got.result).get("job_id", "")) for got in done.values())
    in_scheduler = Counter(rig.platform.scheduler_jobs(team))
    states = job_states(rig)
    runs = agent_successes(rig, set(in_scheduler))
    for got in done.values():  # the workflows' own jobs as the "submit" operations they acknowledged
        job_id = str(json_format.MessageToDict(got.result).get("job_id", ""))
        history.ok(history.invoke(got.workflow_id, "submit", job_id))
    history.dump(rig.platform.root / f"{name}.history.jsonl")
    result = verdict(
        history,
        check_writes(history, "start", completed, where="the completed workflows"),
        check_copies(reported, in_scheduler, what="the scheduler"),
        check_copies(in_scheduler, reported, what="the workflows' results"),
        check_jobs(history, "submit", {j: states.get(j, []) for j in in_scheduler}, runs),
    )
    failed = {k: got.error for k, got in done.items() if k not in completed}
    slowest = max((op.value for op in history.of("start") if op.type == "ok"), default=0.0)
    assert not failed, f"workflows that did not complete: {failed}"
    print(
        f"\nfault {name}: {len(keys)} workflows, {sum(in_scheduler.values())} jobs "
        f"({sum(len(v) for v in runs.values())} run by the agents), "
        f"{result.ops_checked} operations checked; slowest start {slowest:.1f}s; "
        f"every workflow done {recovery:.1f}s after the heal; "
        f"anomalies {len(result.anomalies)}"
    )
    return result, recovery, done


@pytest.mark.asyncio
async def test_scheduler_database_partition_loses_and_repeats_no_job(rig: Rig) -> None:
    result, _, _ = await play(rig, "scheduler_db_partition")
    result.assert_valid()


@pytest.mark.asyncio
async def test_broker_restart_during_a_database_partition(rig: Rig) -> None:
    result, _, _ = await play(rig, "two_at_once")
    result.assert_valid()


@pytest.mark.asyncio
async def test_orchestrator_clock_ten_minutes_ahead(rig: Rig) -> None:
    if faketime_library() is None:
        missing("libfaketime is not installed (apt-get install faketime; `make test` does as root)")
    orchestrator = rig.platform.orchestrator
    skew = clock_env(load_scenario("orchestrator_clock_ahead"), "orchestrator")
    plain = dict(orchestrator.env)
    orchestrator.stop()
    orchestrator.env.update(skew)
    try:
        await asyncio.to_thread(orchestrator.start)
        await asyncio.to_thread(wait_ready, orchestrator)
        result, _, done = await play(rig, "orchestrator_clock_ahead")
    finally:
        orchestrator.stop()
        orchestrator.env = plain
        await asyncio.to_thread(orchestrator.start)
    result.assert_valid()
    # The skew took: the orchestrator stamped the events it received with its own clock.
    with sqlite3.connect(rig.platform.root / "orchestrator" / "orchestrator.db") as conn:
        (newest,) = conn.execute("SELECT max(received_at) FROM job_events").fetchone()
    ahead = (
        dt.datetime.fromisoformat(str(newest)) - dt.datetime.now(dt.UTC).replace(tzinfo=None)
    ).total_seconds()
    assert 300 < ahead < 700, ahead
    # Durable timers still take their time: each workflow held its job HOLD_S, not 0 and not 10 min.
    elapsed = [json_format.MessageToDict(got.result)["elapsed_s"] for got in done.values()]
    assert all(HOLD_S <= e < 120 for e in elapsed), elapsed
