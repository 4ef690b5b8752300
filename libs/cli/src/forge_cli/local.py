"""The local platform's life cycle: what ``forge up``, ``forge down`` and ``forge status`` do.

``up`` is idempotent: a component whose pid file names a live, healthy process is kept, anything
else is (re)started, so ``make up`` twice in a row does nothing the second time but re-run the
main job. Infrastructure comes first (the broker with every topic, Temporal and the MLflow
tracking server), because services connect to them as they start.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from forge_cli import mainjob, platform, profiles, supervisor, tokens
from forge_cli.platform import INFRA, Backing, Infra, ServiceSpec
from forge_cli.supervisor import Component, Paths
from forge_kit.events import ensure_topics
from forge_kit.grpckit import check_health
from forge_kit.localinfra import (
    MLFLOW_SERVER_ENV,
    mlflow_healthy,
    mlflow_server_argv,
    port_open,
    tansu_broker_argv,
)
from forge_kit.paths import private_dir

INFRA_TIMEOUT_S = 120.0
SERVICE_TIMEOUT_S = 180.0


class UpFailed(RuntimeError):
    """A component did not come up; the message says which and shows its log tail."""


def announce_generated(console: Console, new: Mapping[str, str], path: Path) -> None:
    """Name each secret generated just now, never its value (terminal scrollback, CI logs): it
    is in the secrets store (mode 0600) and ``forge keys show NAME`` prints it on request."""
    for name in new:
        console.print(
            f"generated {name} (kept in {path}, mode 0600; show it with: forge keys show {name})",
            highlight=False,
        )


def find_root(start: Path | None = None) -> Path:
    """``$FORGE_ROOT``, else the nearest directory above ``start`` holding ``services/`` and ``libs/``."""
    if env := os.environ.get("FORGE_ROOT"):
        return Path(env).resolve()
    here = (start or Path.cwd()).resolve()
    for candidate in (here, *here.parents):
        if (candidate / "services").is_dir() and (candidate / "libs").is_dir():
            return candidate
    return here


def _executable(name: str) -> str:
    """A tool installed next to this interpreter (the venv), else on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise UpFailed(f"{name} not found: run `make install`")
    return found


# --- components ---------------------------------------------------------------------------------


def tansu_component(infra: Infra) -> Component:
    argv = tansu_broker_argv(f"tcp://{platform.HOST}:{infra.kafka_port}")

    async def healthy() -> bool:
        return port_open(infra.kafka_port)

    return Component(
        name="tansu",
        argv=argv,
        marker=Path(argv[0]).name,
        health=healthy,
        ports=(infra.kafka_port,),
        urls=(f"kafka://{infra.kafka_bootstrap}",),
    )


def temporal_component(infra: Infra, paths: Paths) -> Component:
    binary = _executable("temporal")

    async def healthy() -> bool:
        if not port_open(infra.temporal_port):
            return False
        proc = await asyncio.create_subprocess_exec(
            binary,
            "operator",
            "cluster",
            "health",
            "--address",
            infra.temporal_target,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        return await proc.wait() == 0

    private_dir(paths.temporal_db.parent)
    return Component(
        name="temporal",
        argv=[
            binary,
            "server",
            "start-dev",
            "--ip",
            platform.HOST,
            "--port",
            str(infra.temporal_port),
            "--ui-port",
            str(infra.temporal_ui_port),
            "--db-filename",
            str(paths.temporal_db),
            "--namespace",
            infra.temporal_namespace,
            "--log-level",
            "warn",
        ],
        marker="start-dev",
        health=healthy,
        ports=(infra.temporal_port, infra.temporal_ui_port),
        urls=(infra.temporal_target, infra.temporal_ui_url),
    )


MLFLOW_MARKER = "mlflow server"


def mlflow_component(infra: Infra, paths: Paths, store: str = "") -> Component:
    """The MLflow tracking server: ``store`` (default SQLite under ``var/mlflow``), artifacts
    under ``var/mlflow``, 127.0.0.1 only."""
    paths.mlflow_dir.mkdir(parents=True, exist_ok=True)

    async def healthy() -> bool:
        return port_open(infra.mlflow_port) and await asyncio.to_thread(mlflow_healthy, infra.mlflow_uri)

    return Component(
        name="mlflow",
        argv=mlflow_server_argv(
            infra.mlflow_port,
            store or f"sqlite:///{paths.mlflow_dir / 'mlflow.db'}",
            str(paths.mlflow_dir / "artifacts"),
            host=platform.HOST,
        ),
        env=MLFLOW_SERVER_ENV,
        marker=MLFLOW_MARKER,
        health=healthy,
        ports=(infra.mlflow_port,),
        urls=(infra.mlflow_uri,),
    )


def infra_components(infra: Infra, paths: Paths, mlflow_store: str = "") -> list[Component]:
    return [
        tansu_component(infra),
        temporal_component(infra, paths),
        mlflow_component(infra, paths, mlflow_store),
    ]


async def service_healthy(spec: ServiceSpec) -> bool:
    """HTTP ``/healthz`` answers 200 and the gRPC health service says SERVING."""
    try:
        async with httpx.AsyncClient(timeout=2.0) as client:
            reply = await client.get(f"{spec.http_url}/healthz")
        if reply.status_code != 200:
            return False
    except httpx.HTTPError:
        return False
    return await check_health(spec.grpc_target, timeout_s=2.0)


def service_component(
    spec: ServiceSpec,
    table: Sequence[ServiceSpec],
    secrets: tokens.PlatformSecrets,
    paths: Paths,
    infra: Infra = INFRA,
    backing: Backing | None = None,
) -> Component:
    """``spec`` as a process; ``backing``: production-shaped settings on top (``--profile prod-like``)."""
    private_dir(paths.data_dir(spec.name))
    env = platform.service_env(
        spec,
        table,
        secrets.tokens,
        paths.root,
        infra,
        event_keys=secrets.event_keys,
        generated=secrets.generated,
    )
    if backing is not None:
        env.update({f"{spec.prefix}{k}": v for k, v in platform.production_env(spec, backing).items()})

    async def healthy() -> bool:
        return await service_healthy(spec)

    return Component(
        name=spec.name,
        argv=[sys.executable, "-m", spec.module],
        marker=spec.module,
        health=healthy,
        ports=(spec.grpc_port, spec.http_port),
        env=env,
        urls=(spec.grpc_target, spec.http_url),
    )


def context(
    paths: Paths,
    specs: Sequence[ServiceSpec],
    secrets: dict[str, str],
    infra: Infra = INFRA,
    backing: Backing | None = None,
) -> mainjob.MainJobContext:
    """What the main job's steps get to reach the platform."""
    databases = {}
    if backing is not None:
        databases = {s.name: platform.production_env(s, backing).get("DATABASE_URL", "") for s in specs}
    endpoints = {
        s.name: mainjob.ServiceEndpoint(s.name, s.grpc_target, s.http_url, secrets[s.name]) for s in specs
    }
    return mainjob.MainJobContext(
        root=paths.root,
        services=endpoints,
        kafka_bootstrap=infra.kafka_bootstrap,
        temporal_target=infra.temporal_target,
        temporal_namespace=infra.temporal_namespace,
        object_store_url=str(paths.objects),
        mlflow_url=infra.mlflow_uri,
        database_urls={name: url for name, url in databases.items() if url},
    )


# --- up -----------------------------------------------------------------------------------------


@dataclass
class Started:
    component: Component
    pid: int
    state: str  # "started" or "running" (was already up)


#: What a server's log says when another socket held its port at the moment it bound (lower case).
#: The platform's default ports (50051-50059, 8050-8059) lie inside Linux's ephemeral range
#: (32768-60999), so any process's outgoing connection — Temporal's dev server opens dozens at
#: start — can hold one for a while; seen once in a `make up` right after a test run. Temporal's
#: dev server also picks free ports for its internal services and panics with "failed assigning
#: ephemeral port" when one was taken before it bound it (seen with test folders side by side).
BIND_FAILURES = ("failed to bind to address", "address already in use", "failed assigning ephemeral port")
BIND_RETRY_S = 2.0


#: The line that names a Go binary's crash (Temporal's dev server): its goroutine dump follows
#: it, often past the log's last lines. (A Python traceback names its error on its last line.)
CRASH_HEADS = re.compile(r"^(panic: |fatal error: )", re.MULTILINE)


def _crash_report(log: str) -> str:
    """The line where ``log``'s crash report starts, quoted, or nothing when it has none."""
    found = CRASH_HEADS.search(log)
    if found is None:
        return ""
    line = log[found.start() :].split("\n", 1)[0]
    return f"it reported {line!r}; "


async def _wait_healthy(started: Started, paths: Paths, timeout_s: float) -> None:
    """Wait until ``started`` answers its health check. A process that exits because its port
    was taken is started again until the deadline (its pid in ``started`` follows); any other
    exit, or the deadline, fails with the log's last lines (and the line naming a Go crash)."""
    component = started.component
    deadline = time.monotonic() + timeout_s
    while True:
        if not supervisor.is_running(started.pid, component.marker):
            this_run = supervisor.last_start_log(paths, component.name)  # not an earlier start's
            lost_port = any(failure in this_run.lower() for failure in BIND_FAILURES)
            if lost_port and time.monotonic() + BIND_RETRY_S < deadline:
                await asyncio.sleep(BIND_RETRY_S)
                started.pid = supervisor.spawn(component, paths)
                continue
            raise UpFailed(
                f"{component.name} exited during start-up; {_crash_report(this_run)}"
                f"last lines of {paths.log_file(component.name)}:\n{supervisor.log_tail(paths, component.name)}"
            )
        if await component.health():
            return
        if time.monotonic() > deadline:
            raise UpFailed(
                f"{component.name} not healthy within {timeout_s:.0f}s; last lines of "
                f"{paths.log_file(component.name)}:\n{supervisor.log_tail(paths, component.name)}"
            )
        await asyncio.sleep(0.25)


def _ensure_started(component: Component, paths: Paths) -> Started:
    """Keep the live process named by the pid file, or start a new one; never two."""
    pid = supervisor.live_pid(paths, component.name, component.marker)
    if pid is not None:
        return Started(component, pid, "running")
    supervisor.remove_pid_files(paths, [component.name])
    busy = [p for p in component.ports if port_open(p)]
    if busy:
        raise UpFailed(
            f"cannot start {component.name}: port(s) {', '.join(map(str, busy))} already in use "
            "by a process forge did not start (stop it, or run `forge down` from its checkout)"
        )
    return Started(component, supervisor.spawn(component, paths), "started")


async def bring_up(components: Sequence[Component], paths: Paths, timeout_s: float) -> list[Started]:
    """Start the missing ones among ``components`` together, then wait until all are healthy."""
    started = [_ensure_started(c, paths) for c in components]
    results = await asyncio.gather(
        *(_wait_healthy(s, paths, timeout_s) for s in started), return_exceptions=True
    )
    errors = [str(r) for r in results if isinstance(r, BaseException)]
    if errors:
        raise UpFailed("\n\n".join(errors))
    return started


def table_of(started: Sequence[Started]) -> Table:
    table = Table(title="Forge platform", title_justify="left")
    for column in ("component", "pid", "state", "addresses", "log"):
        table.add_column(column)
    for s in started:
        table.add_row(
            s.component.name,
            str(s.pid),
            s.state,
            "  ".join(s.component.urls),
            f"var/log/{s.component.name}.log",
        )
    return table


async def up(
    paths: Paths,
    specs: Sequence[ServiceSpec],
    console: Console,
    *,
    run_main_job: bool = True,
    timeout_s: float = SERVICE_TIMEOUT_S,
    infra: Infra = INFRA,
    table: Sequence[ServiceSpec] = platform.SERVICES,
    profile: profiles.Profile | None = None,
) -> int:
    """Bring ``specs`` (rows of ``table``) up, print them, run the main job; 0 only if all worked.
    Rows with ``instances`` > 1 start that many local copies, rows with 0 none. A ``profile`` moves the rows to its
    ports and infrastructure and gives them its backing services (``forge up --profile``)."""
    table = platform.local_table(table)
    specs = platform.started(platform.local_table(specs))
    backing = None
    if profile is not None:
        table, specs, infra, backing = (
            profile.table(table),
            profile.table(specs),
            profile.infra,
            profile.backing,
        )
    problems = platform.validate(table)
    if problems:
        console.print("[red]platform table is inconsistent:[/] " + "; ".join(problems))
        return 2
    secrets = tokens.load_platform(paths.tokens, paths.event_keys, paths.generated, table)
    announce_generated(console, secrets.new, paths.generated)
    paths.objects.mkdir(parents=True, exist_ok=True)
    try:
        if profile is not None and profile.backing is not None:
            dbs = await profiles.ensure_databases(profile, table)
            if dbs.created:
                console.print(f"created PostgreSQL databases: {', '.join(dbs.created)}", highlight=False)
            if dbs.reset:
                console.print(
                    f"reset PostgreSQL databases that were not this state folder's ({profile.root}: "
                    "it was new, or they were another stopped checkout's): "
                    f"{', '.join(dbs.reset)}; the profile's Redis keys were cleared too",
                    highlight=False,
                )
        with console.status("starting the broker, the Temporal dev server and the MLflow server…"):
            mlflow_store = profile.mlflow_store if profile is not None else ""
            infra_up = await bring_up(infra_components(infra, paths, mlflow_store), paths, INFRA_TIMEOUT_S)
            await ensure_topics(infra.kafka_bootstrap)
        components = [service_component(s, table, secrets, paths, infra, backing) for s in specs]
        with console.status(f"starting {len(components)} services and waiting for their health checks…"):
            services_up = await bring_up(components, paths, timeout_s)
    except (UpFailed, profiles.BackingUnavailable) as exc:
        console.print(f"[red]forge up failed:[/]\n{exc}")
        console.print("Components that did start are left running: `forge status`, `forge down`.")
        return 1
    console.print(table_of([*infra_up, *services_up]))
    if not run_main_job:
        return 0
    return await run_main(context(paths, platform.started(table), secrets.tokens, infra, backing), console)


async def run_main(ctx: mainjob.MainJobContext, console: Console) -> int:
    steps = mainjob.discover()
    if not steps:
        console.print(
            f"[red]no main job step is registered[/] (entry-point group {mainjob.GROUP!r}); "
            "is every service installed? (`make install`)"
        )
        return 1
    console.print(f"main job: {len(steps)} step(s): {', '.join(s.name for s in steps)}")
    outcomes = await mainjob.run(steps, ctx, console)
    for outcome in outcomes:
        console.print(mainjob.render(outcome))
    if all(o.ok for o in outcomes) and len(outcomes) == len(steps):
        console.print("[green]main job finished[/]; the platform keeps running (`forge down` stops it).")
        return 0
    console.print("[red]main job failed[/]; logs are in var/log/.")
    return 1


# --- down and status ----------------------------------------------------------------------------


def _markers(specs: Sequence[ServiceSpec]) -> dict[str, str | None]:
    markers: dict[str, str | None] = {"tansu": "tansu", "temporal": "start-dev", "mlflow": MLFLOW_MARKER}
    markers.update({s.name: s.module for s in specs})
    return markers


def down(paths: Paths, console: Console, table: Sequence[ServiceSpec] = platform.SERVICES) -> int:
    """Stop every component that has a pid file (services and infrastructure alike)."""
    markers = _markers(platform.local_table(table))
    names = supervisor.pid_file_names(paths)
    live = {}
    for name in names:
        pid = supervisor.live_pid(paths, name, markers.get(name))
        if pid is not None:
            live[name] = pid
    if not live:
        supervisor.remove_pid_files(paths, names)
        console.print("nothing is running")
        return 0
    with console.status(f"stopping {', '.join(live)}…"):
        outcome = supervisor.stop(live)
    report = Table(title="forge down", title_justify="left")
    report.add_column("component")
    report.add_column("pid")
    report.add_column("result")
    for name, pid in live.items():
        report.add_row(name, str(pid), outcome[name])
    console.print(report)
    leftover = [n for n, r in outcome.items() if r.startswith("still")]
    supervisor.remove_pid_files(paths, [n for n in names if n not in leftover])
    return 1 if leftover else 0


async def status(paths: Paths, specs: Sequence[ServiceSpec], console: Console, infra: Infra = INFRA) -> int:
    """Print each component's pid, liveness and health; 0 when every one is healthy (``specs`` on
    the ports they run on: a profile's, :meth:`profiles.Profile.table`)."""
    components = infra_components(infra, paths)
    components += [
        Component(s.name, [], s.module, _bound_health(s), urls=(s.grpc_target, s.http_url))
        for s in platform.started(platform.local_table(specs))
    ]
    table = Table(title="Forge platform", title_justify="left")
    for column in ("component", "pid", "alive", "healthy", "addresses"):
        table.add_column(column)
    all_healthy = True
    for c in components:
        pid = supervisor.read_pid(paths, c.name)
        alive = pid is not None and supervisor.is_running(pid, c.marker)
        healthy = await c.health()
        all_healthy &= alive and healthy
        table.add_row(c.name, str(pid or "-"), _yes(alive), _yes(healthy), "  ".join(c.urls))
    console.print(table)
    return 0 if all_healthy else 1


def _bound_health(spec: ServiceSpec) -> supervisor.HealthCheck:
    async def healthy() -> bool:
        return await service_healthy(spec)

    return healthy


def _yes(flag: bool) -> str:
    return "[green]yes[/]" if flag else "[red]no[/]"
