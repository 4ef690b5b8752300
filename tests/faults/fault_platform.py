"""Harness of the fault suite: a small real platform for fault injection: Tansu, a Temporal dev server with a database file
(so it survives a restart), the scheduler and the orchestrator as processes on fixed ports, so
each can be killed and started again in place."""

from __future__ import annotations

import asyncio
import sqlite3
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from forge_kit.events import ensure_topics
from forge_kit.testing import ServiceProcess, TansuBroker, TemporalDevServer, free_port

SCHEDULER_TOKEN = "faults-scheduler-token"
ORCHESTRATOR_TOKEN = "faults-orchestrator-token"


@dataclass
class Platform:
    broker: TansuBroker
    temporal: TemporalDevServer
    scheduler: ServiceProcess
    orchestrator: ServiceProcess
    root: Path

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
        with sqlite3.connect(self.root / "scheduler" / "scheduler.db") as conn:
            return [str(r[0]) for r in conn.execute("SELECT id FROM jobs WHERE team = ?", (team,))]


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


def start_platform(root: Path, scheduler_env: dict[str, str] | None = None) -> Platform:
    broker = TansuBroker(log_path=str(root / "tansu.log")).start()
    asyncio.run(ensure_topics(broker.bootstrap))
    temporal = TemporalDevServer(
        db_file=str(root / "temporal.db"), log_path=str(root / "temporal.log")
    ).start()
    scheduler_ports = (free_port(), free_port())
    scheduler = ServiceProcess(
        "forge_scheduler",
        env={
            "FORGE_SCHEDULER_GRPC_PORT": str(scheduler_ports[0]),
            "FORGE_SCHEDULER_HTTP_PORT": str(scheduler_ports[1]),
            "FORGE_SCHEDULER_DATA_DIR": str(root / "scheduler"),
            "FORGE_SCHEDULER_KAFKA_BOOTSTRAP": broker.bootstrap,
            "FORGE_SCHEDULER_AUTH_TOKEN": SCHEDULER_TOKEN,
            **(scheduler_env or {}),
        },
        log_path=str(root / "scheduler.log"),
    ).start()
    orchestrator = ServiceProcess(
        "forge_orchestrator",
        env={
            "FORGE_ORCHESTRATOR_GRPC_PORT": str(free_port()),
            "FORGE_ORCHESTRATOR_HTTP_PORT": str(free_port()),
            "FORGE_ORCHESTRATOR_AUTH_TOKEN": ORCHESTRATOR_TOKEN,
            "FORGE_ORCHESTRATOR_DATA_DIR": str(root / "orchestrator"),
            "FORGE_ORCHESTRATOR_KAFKA_BOOTSTRAP": broker.bootstrap,
            "FORGE_ORCHESTRATOR_TEMPORAL_TARGET": temporal.target,
            "FORGE_ORCHESTRATOR_CONSUMER_SESSION_TIMEOUT_MS": "3000",
            "FORGE_ORCHESTRATOR_CATCH_UP_INTERVAL_S": "2",
            "FORGE_ORCHESTRATOR_SCHEDULER_TARGET": f"127.0.0.1:{scheduler_ports[0]}",
            "FORGE_ORCHESTRATOR_SCHEDULER_TOKEN": SCHEDULER_TOKEN,
        },
        log_path=str(root / "orchestrator.log"),
    ).start()
    wait_ready(orchestrator)
    return Platform(broker, temporal, scheduler, orchestrator, root)


def stop_platform(platform: Platform) -> None:
    for component in (platform.orchestrator, platform.scheduler, platform.temporal, platform.broker):
        component.stop()  # type: ignore[attr-defined]
