"""Harness of the fault suite: a small real platform for fault injection: Tansu, a Temporal dev server with a database file
(so it survives a restart), the scheduler and the orchestrator as processes on fixed ports, so
each can be killed and started again in place."""

from __future__ import annotations

import asyncio
import os
import shutil
import sqlite3
import subprocess
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg

from forge_kit.events import ensure_topics
from forge_kit.testing import ServiceProcess, TansuBroker, TemporalDevServer, base_env, free_port

SCHEDULER_TOKEN = "faults-scheduler-token"
ORCHESTRATOR_TOKEN = "faults-orchestrator-token"
AGENT_TOKEN = "faults-agent-token"


class PrivatePostgres:
    """A PostgreSQL cluster of our own (``initdb`` in a temporary folder, a free port), so the
    suite can crash and restart it without touching the machine's shared server. ``restart()``
    stops it in ``immediate`` mode — no checkpoint, crash recovery on start, as after kill -9."""

    def __init__(self) -> None:
        # Its own folder under /tmp, not pytest's (root-only) one: as root, the server runs as
        # the ``postgres`` user, which must be able to reach it.
        self.root = Path(tempfile.mkdtemp(prefix="forge-faults-pg-"))
        self.data = self.root / "pgdata"
        self.port = free_port()
        self.log = self.root / "postgres.log"
        self._as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    @staticmethod
    def available() -> bool:
        return shutil.which("pg_ctl") is not None and shutil.which("initdb") is not None

    def _run(self, *argv: str) -> None:
        subprocess.run([*self._as_postgres, *argv], check=True, capture_output=True, timeout=120)

    def init(self) -> PrivatePostgres:
        if self._as_postgres:
            shutil.chown(self.root, "postgres")
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8")
        return self.start()

    def start(self) -> PrivatePostgres:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=on"
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "start")
        return self

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def remove(self) -> None:
        """Stop (if running) and delete the cluster."""
        subprocess.run(
            [*self._as_postgres, "pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop"],
            capture_output=True,
            timeout=120,
        )
        shutil.rmtree(self.root, ignore_errors=True)

    def restart(self) -> float:
        """Crash-stop and start again; seconds until it accepts connections."""
        self.stop("immediate")
        stopped = time.monotonic()
        self.start()
        return time.monotonic() - stopped

    def create_database(self, name: str) -> str:
        async def create() -> None:
            conn = await asyncpg.connect(f"postgresql://postgres@127.0.0.1:{self.port}/postgres")
            try:
                await conn.execute(f'CREATE DATABASE "{name}"')
            finally:
                await conn.close()

        asyncio.run(create())
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/{name}"


@dataclass
class Platform:
    broker: TansuBroker
    temporal: TemporalDevServer
    scheduler: ServiceProcess
    orchestrator: ServiceProcess
    root: Path
    scheduler_database_url: str = field(default="")

    def components(self) -> dict[str, object]:
        return {
            "broker": self.broker,
            "temporal": self.temporal,
            "scheduler": self.scheduler,
            "orchestrator": self.orchestrator,
        }

    def job_events(self, state: str) -> list[str]:
        """Job ids the orchestrator recorded in ``state`` (one row per applied event)."""
        with sqlite3.connect(self.root / "orchestrator" / "orchestrator.db") as conn:
            return [
                str(r[0]) for r in conn.execute("SELECT job_id FROM job_events WHERE state = ?", (state,))
            ]

    def scheduler_jobs(self, team: str) -> list[str]:
        if self.scheduler_database_url:
            # A thread of its own: the caller may be inside an event loop (an async test).
            with ThreadPoolExecutor(1) as pool:
                return pool.submit(asyncio.run, self._postgres_jobs(team)).result()
        with sqlite3.connect(self.root / "scheduler" / "scheduler.db") as conn:
            return [str(r[0]) for r in conn.execute("SELECT id FROM jobs WHERE team = ?", (team,))]

    async def _postgres_jobs(self, team: str) -> list[str]:
        conn = await asyncpg.connect(self.scheduler_database_url.replace("postgresql+asyncpg", "postgresql"))
        try:
            return [str(r[0]) for r in await conn.fetch("SELECT id FROM jobs WHERE team = $1", team)]
        finally:
            await conn.close()


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


def wait_ready(process: ServiceProcess, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _http_ok(f"{process.http_url}/readyz"):
            return
        time.sleep(0.1)
    raise TimeoutError(f"{process.module} not ready in {timeout_s}s")


def start_platform(
    root: Path, scheduler_env: dict[str, str] | None = None, orchestrator_env: dict[str, str] | None = None
) -> Platform:
    broker = TansuBroker(log_path=str(root / "tansu.log")).start()
    asyncio.run(ensure_topics(broker.bootstrap))
    temporal = TemporalDevServer(
        db_file=str(root / "temporal.db"), log_path=str(root / "temporal.log")
    ).start()
    scheduler_ports = (free_port(), free_port())
    scheduler = ServiceProcess(
        "forge_scheduler",
        env={
            **base_env(
                "scheduler",
                token=SCHEDULER_TOKEN,
                data_dir=root / "scheduler",
                kafka=broker.bootstrap,
                grpc_port=scheduler_ports[0],
                http_port=scheduler_ports[1],
            ),
            **(scheduler_env or {}),
        },
        log_path=str(root / "scheduler.log"),
    ).start()
    orchestrator = ServiceProcess(
        "forge_orchestrator",
        env={
            **base_env(
                "orchestrator",
                token=ORCHESTRATOR_TOKEN,
                data_dir=root / "orchestrator",
                kafka=broker.bootstrap,
                grpc_port=free_port(),
                http_port=free_port(),
                temporal_target=temporal.target,
                consumer_session_timeout_ms="3000",
                catch_up_interval_s="2",
                scheduler_target=f"127.0.0.1:{scheduler_ports[0]}",
                scheduler_token=SCHEDULER_TOKEN,
            ),
            **(orchestrator_env or {}),
        },
        log_path=str(root / "orchestrator.log"),
    ).start()
    wait_ready(orchestrator)
    url = (scheduler_env or {}).get("FORGE_SCHEDULER_DATABASE_URL", "")
    return Platform(broker, temporal, scheduler, orchestrator, root, scheduler_database_url=url)


def stop_platform(platform: Platform) -> None:
    for component in (platform.orchestrator, platform.scheduler, platform.temporal, platform.broker):
        component.stop()  # type: ignore[attr-defined]


def agent_process(platform: Platform, name: str, gpus: str = "SIMx1") -> ServiceProcess:
    """A trainer agent (node ``name``, simulated GPUs) on ports of its own, its data under the
    platform's root, checkpoints in the shared object store ``root/objects``."""
    root = platform.root
    return ServiceProcess(
        "forge_trainer_agent",
        env=base_env(
            "trainer_agent",
            token=AGENT_TOKEN,
            data_dir=root / name,
            kafka=platform.broker.bootstrap,
            grpc_port=free_port(),
            http_port=free_port(),
            object_store_url=str(root / "objects"),
            scheduler_target=platform.scheduler.grpc_target,
            scheduler_token=SCHEDULER_TOKEN,
            node_name=name,
            gpus=gpus,
            reconnect_max_s="2",
        ),
        log_path=str(root / f"{name}.log"),
    )


def dead_letters(*databases: Path) -> list[tuple[str, str]]:
    """(consumer group, error) of every dead-lettered event in these SQLite databases."""
    found: list[tuple[str, str]] = []
    for path in databases:
        with sqlite3.connect(path) as conn:
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if "forge_dead_letters" in tables:
                rows = conn.execute("SELECT consumer_group, error FROM forge_dead_letters")
                found += [(str(a), str(b)) for a, b in rows]
    return found


def model_server_process(root: Path, name: str, token: str) -> ServiceProcess:
    """A model_server over ``root/models`` on ports of its own (so it can be killed and started
    again in place), one torch thread, Kafka off."""
    return ServiceProcess(
        "forge_model_server",
        env=base_env(
            "model_server",
            token=token,
            grpc_port=free_port(),
            http_port=free_port(),
            models_dir=str(root / "models"),
            torch_threads="1",
        ),
        cwd=str(root),
        log_path=str(root / f"{name}.log"),
    )


def vllm_metric(process: ServiceProcess, name: str) -> float:
    """The sum over labels of one metric on a model server's ``/metrics`` (vLLM's names)."""
    with urllib.request.urlopen(f"{process.http_url}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))
