"""Issue 22, hole 1: a job must not reach its trainer agent's secrets.

The platform is laid out as ``forge up`` lays it out (``var/secrets/tokens.json`` of mode 0600,
each service's data under ``var/data/<name>``, the object store in ``var/objects``), with a real
scheduler and a real trainer agent process holding the scheduler's admin token in its
environment. A team that holds only a team token submits a job whose command is the attack: it
walks every ``/proc/<pid>/environ`` for tokens, reads the secrets file and the agent's database,
writes outside its run directory and lists the processes it can see. Every attempt must fail,
while the job's own declared environment is there.

Where the node cannot isolate jobs (``job_sandbox`` pointing at a missing binary), the agent does
not start unless an operator opted in. Turned off explicitly (``job_sandbox`` empty), the agent
says so to the scheduler (``forge cluster`` shows it) and refuses the team's job with the reason;
a job an admin submitted still runs.

A job placed on one node has its own network namespace: nothing listening on the host —
Temporal, PostgreSQL, Redis, the scheduler, the agent's own ports, any other local listener —
answers it, while its own loopback works (its replicas' rendezvous).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from forge.common.v1 import common_pb2
from forge.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from typer.testing import CliRunner

from forge_cli import tokens
from forge_kit.grpckit import make_channel
from forge_kit.testing import ServiceProcess, TemporalDevServer, base_env, eventually, free_port
from forge_scheduler.cli import cluster_app

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the agent isolates jobs only when it runs as root")

ATTACK = r"""
import json, os, sys
from pathlib import Path

secrets_file, agent_db, repo_file = sys.argv[1], sys.argv[2], sys.argv[3]
found = {"uid": os.getuid(), "pids": [], "tokens": [], "read": [], "wrote": []}
for entry in os.listdir("/proc"):
    if not entry.isdigit():
        continue
    found["pids"].append(int(entry))
    try:
        environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
    except OSError:
        continue
    for item in environ:
        key, _, value = item.decode(errors="replace").partition("=")
        if key.startswith("FORGE_") and ("TOKEN" in key or "SECRET" in key) and value:
            found["tokens"].append(f"{entry}:{key}")
for target in (secrets_file, agent_db, "/etc/shadow"):
    try:
        Path(target).read_bytes()
        found["read"].append(target)
    except OSError:
        pass
for target in (str(Path(secrets_file).parent / "pwned"), str(Path(agent_db).parent / "pwned"), repo_file):
    try:
        Path(target).write_text("pwned")
        found["wrote"].append(target)
    except OSError:
        pass
found["own_env"] = sorted(k for k in os.environ if "TOKEN" in k or k.startswith("FORGE_TRAINER_AGENT"))
found["greeting"] = os.environ.get("JOB_GREETING")
print("ATTACK " + json.dumps(found), flush=True)
"""


class Platform:
    """A scheduler and one trainer agent, with tokens and folders as ``forge up`` makes them."""

    def __init__(self, root: Path, agent_settings: dict[str, str]) -> None:
        self.root = root
        self.secrets = tokens.load_or_create(
            root / "var" / "secrets" / "tokens.json", ["scheduler", "trainer_agent"]
        )
        self.secrets_file = root / "var" / "secrets" / "tokens.json"
        self.agent_data = root / "var" / "data" / "trainer_agent"
        self.scheduler = ServiceProcess(
            "forge_scheduler",
            env=base_env(
                "scheduler",
                token=self.secrets["scheduler"],
                data_dir=root / "var" / "data" / "scheduler",
                grpc_port=free_port(),
                http_port=free_port(),
                heartbeat_interval_s="1",
            ),
            log_path=str(root / "scheduler.log"),
        )
        self.agent = ServiceProcess(
            "forge_trainer_agent",
            env={
                **base_env(
                    "trainer_agent",
                    token=self.secrets["trainer_agent"],
                    data_dir=self.agent_data,
                    object_store_url=str(root / "var" / "objects"),
                    scheduler_token=self.secrets["scheduler"],
                    node_name="node-sec",
                    gpus="SIMx1",
                ),
                **agent_settings,
            },
            log_path=str(root / "agent.log"),
        )

    def start(self) -> Platform:
        self.scheduler.start()
        self.agent.env["FORGE_TRAINER_AGENT_SCHEDULER_TARGET"] = self.scheduler.grpc_target
        self.agent.start()
        return self

    def stop(self) -> None:
        self.agent.stop()
        self.scheduler.stop()

    def admin(self) -> Any:
        return make_channel(self.scheduler.grpc_target, token=self.secrets["scheduler"])

    async def node(self) -> scheduler_pb2.Node:
        async with self.admin() as channel:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)

            async def ready() -> scheduler_pb2.Node | None:
                nodes = (await stub.ListNodes(scheduler_pb2.ListNodesRequest())).nodes
                return next((n for n in nodes if n.state == scheduler_pb2.NODE_STATE_READY), None)

            node: scheduler_pb2.Node = await eventually(ready)
            return node

    async def team_token(self, team: str) -> str:
        async with self.admin() as channel:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
            quota = scheduler_pb2.Quota(gpu_type="SIM", guaranteed_gpus=1, weight=1)
            await stub.CreateTeam(scheduler_pb2.CreateTeamRequest(name=team, quotas=[quota]))
            issued = await stub.IssueTeamToken(scheduler_pb2.IssueTeamTokenRequest(team=team))
            return str(issued.token)

    async def run_job(
        self, token: str, team: str, command: list[str], env: dict[str, str], on_behalf_of: str = ""
    ) -> scheduler_pb2.Job:
        """Submit with ``token`` and wait for a terminal state."""
        async with make_channel(self.scheduler.grpc_target, token=token) as channel:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
            spec = scheduler_pb2.JobSpec(
                name="attack",
                team=team,
                priority_class="normal",
                command=command,
                env=env,
                resources=common_pb2.ResourceRequest(gpu_type="SIM", gpu_count=1),
            )
            request = scheduler_pb2.SubmitJobRequest(spec=spec, on_behalf_of=on_behalf_of)
            job = (await stub.SubmitJob(request)).job
            terminal = {
                common_pb2.JOB_STATE_SUCCEEDED,
                common_pb2.JOB_STATE_FAILED,
                common_pb2.JOB_STATE_CANCELLED,
            }

            async def done() -> scheduler_pb2.Job | None:
                got = (await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job.id))).job
                return got if got.state in terminal else None

            finished: scheduler_pb2.Job = await eventually(done, timeout_s=120)
            return finished

    def job_log(self, job_id: str) -> str:
        return "\n".join(
            p.read_text() for p in sorted((self.agent_data / "runs" / job_id).glob("attempt-*.log"))
        )


@pytest.fixture
def isolated(tmp_path: Path) -> Iterator[Platform]:
    platform = Platform(tmp_path, {}).start()
    yield platform
    platform.stop()


@pytest.fixture
def unisolated(tmp_path: Path) -> Iterator[Platform]:
    # Isolation turned off explicitly: the only way an agent runs without it (besides
    # allow_unisolated_jobs); an agent that merely cannot isolate refuses to start.
    platform = Platform(tmp_path, {"FORGE_TRAINER_AGENT_JOB_SANDBOX": ""}).start()
    yield platform
    platform.stop()


async def test_a_team_job_reaches_no_secret_of_its_agent(isolated: Platform) -> None:
    node = await isolated.node()
    assert node.job_isolation.isolated, node.job_isolation.detail
    token = await isolated.team_token("research")
    repo_file = Path(__file__).resolve().parent / "pwned-by-job"
    repo_file.unlink(missing_ok=True)
    agent_db = isolated.agent_data / "trainer_agent.db"
    assert agent_db.exists() and isolated.secrets_file.exists()

    job = await isolated.run_job(
        token,
        "research",
        [sys.executable, "-c", ATTACK, str(isolated.secrets_file), str(agent_db), str(repo_file)],
        {"JOB_GREETING": "hello"},
    )

    log = isolated.job_log(job.id)
    with contextlib.suppress(OSError):
        (Path("/dev/shm") / f"forge-job-{job.id}").rmdir()
    assert job.state == common_pb2.JOB_STATE_SUCCEEDED, f"{job.message}\n{log}"
    line = next(line for line in log.splitlines() if line.startswith("ATTACK "))
    found = json.loads(line.removeprefix("ATTACK "))
    assert found["tokens"] == [], "a job read tokens from another process's environment"
    assert found["read"] == [], "a job read the secrets file, the agent's database or /etc/shadow"
    assert found["wrote"] == [], "a job wrote outside its run directory"
    assert found["own_env"] == [], "the agent's settings leaked into the job's environment"
    assert found["uid"] != 0, "the job ran as root"
    assert max(found["pids"]) < 10, f"the job sees host processes: {found['pids']}"
    assert found["greeting"] == "hello", "the job's declared environment is missing"
    written = [
        p
        for p in (isolated.secrets_file.parent / "pwned", isolated.agent_data / "pwned", repo_file)
        if p.exists()
    ]
    repo_file.unlink(missing_ok=True)
    assert written == [], f"{written} were written by the job"


async def test_a_node_that_cannot_isolate_refuses_team_jobs_and_says_so(unisolated: Platform) -> None:
    node = await unisolated.node()
    assert not node.job_isolation.isolated
    assert "turned off" in node.job_isolation.detail
    shown = await asyncio.to_thread(
        CliRunner().invoke,
        cluster_app,
        ["--target", unisolated.scheduler.grpc_target, "--json"],
        env={"FORGE_CLI_SCHEDULER_TOKEN": unisolated.secrets["scheduler"]},
    )
    assert shown.exit_code == 0, shown.output
    row = json.loads(shown.output)["nodes"][0]
    assert row["isolation"].startswith("NONE, admin jobs only"), row
    token = await unisolated.team_token("research")
    marker = unisolated.root / "team-job-ran"

    refused = await unisolated.run_job(
        token, "research", [sys.executable, "-c", f"open({str(marker)!r}, 'w')"], {}
    )

    assert refused.state == common_pb2.JOB_STATE_FAILED
    assert "cannot isolate jobs" in refused.message and "allow_unisolated_jobs" in refused.message
    assert not marker.exists()
    # An admin relaying the team's submission (the orchestrator's workflows) is the team's.
    relayed = await unisolated.run_job(
        unisolated.secrets["scheduler"],
        "research",
        [sys.executable, "-c", f"open({str(marker)!r}, 'w')"],
        {},
        on_behalf_of="research",
    )
    assert relayed.state == common_pb2.JOB_STATE_FAILED and "cannot isolate jobs" in relayed.message
    assert not marker.exists()
    admin_job = await unisolated.run_job(
        unisolated.secrets["scheduler"], "research", [sys.executable, "-c", "pass"], {}
    )
    assert admin_job.state == common_pb2.JOB_STATE_SUCCEEDED, admin_job.message


PROBE = r"""
import json, socket, sys
found = {}
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
        found[target] = "connected"
    except OSError as exc:
        found[target] = type(exc).__name__
own = socket.socket()
own.bind(("127.0.0.1", 0))
own.listen()
socket.create_connection(own.getsockname(), timeout=5).close()
found["own loopback"] = "connected"
print("PROBE " + json.dumps(found), flush=True)
"""


async def test_a_team_job_reaches_no_port_on_the_host(
    isolated: Platform, temporal_server: TemporalDevServer
) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    targets = {
        "temporal": temporal_server.target,
        "postgresql": "127.0.0.1:5432",
        "redis": "127.0.0.1:6379",
        "scheduler": isolated.scheduler.grpc_target,
        "scheduler http": isolated.scheduler.http_url.removeprefix("http://"),
        "agent": isolated.agent.grpc_target,
        "agent http": isolated.agent.http_url.removeprefix("http://"),
        "a host listener": f"127.0.0.1:{listener.getsockname()[1]}",
    }
    token = await isolated.team_token("research")
    try:
        job = await isolated.run_job(token, "research", [sys.executable, "-c", PROBE, *targets.values()], {})
    finally:
        listener.close()
    log = isolated.job_log(job.id)
    with contextlib.suppress(OSError):
        (Path("/dev/shm") / f"forge-job-{job.id}").rmdir()
    assert job.state == common_pb2.JOB_STATE_SUCCEEDED, f"{job.message}\n{log}"
    found = json.loads(next(x for x in log.splitlines() if x.startswith("PROBE ")).removeprefix("PROBE "))
    reached = {name: t for name, t in targets.items() if found[t] == "connected"}
    assert reached == {}, f"a job reached host ports: {reached}"
    assert found["own loopback"] == "connected"


def test_an_agent_that_cannot_isolate_does_not_start_unless_told(tmp_path: Path) -> None:
    platform = Platform(tmp_path, {"FORGE_TRAINER_AGENT_JOB_SANDBOX": str(tmp_path / "no-such-bwrap")})
    platform.scheduler.start()
    platform.agent.env["FORGE_TRAINER_AGENT_SCHEDULER_TARGET"] = platform.scheduler.grpc_target
    try:
        with pytest.raises(RuntimeError, match="exited"):
            platform.agent.start(60)
        log = (tmp_path / "agent.log").read_text()
        assert "jobs cannot be isolated here" in log and "no-such-bwrap not found" in log, log[-2000:]
        # Opted in explicitly: it starts, and says loudly that jobs are not isolated.
        platform.agent.env["FORGE_TRAINER_AGENT_ALLOW_UNISOLATED_JOBS"] = "true"
        platform.agent.start(60)
        assert "JOBS ARE NOT ISOLATED" in (tmp_path / "agent.log").read_text()
    finally:
        platform.stop()
