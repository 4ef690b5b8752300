"""`forge up` / `forge down`: the main job's steps, and up/down against real processes."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from forge_cli import local, mainjob, supervisor
from forge_cli.platform import Infra, ServiceSpec
from forge_kit.testing.processes import free_port, port_open

# --- the main job -------------------------------------------------------------------------------


def _ctx() -> mainjob.MainJobContext:
    return mainjob.MainJobContext(
        root=Path("."),
        services={},
        kafka_bootstrap="k",
        temporal_target="t",
        temporal_namespace="default",
        object_store_url="o",
    )


def _step(name: str, fn: Any, order: int = 100) -> mainjob.Step:
    return mainjob.Step(name, fn, order, 5.0)


def test_discover_orders_steps_by_order_then_name(monkeypatch: pytest.MonkeyPatch) -> None:
    async def late(ctx: Any) -> dict[str, Any]:
        return {}

    async def early(ctx: Any) -> dict[str, Any]:
        return {}

    early.order = 10  # type: ignore[attr-defined]
    fake = {"zeta": early, "alpha": late, "beta": late}

    class FakeEP:
        def __init__(self, name: str) -> None:
            self.name, self.value = name, f"x:{name}"

        def load(self) -> Any:
            if self.name == "broken":
                raise ImportError("no module")
            return fake[self.name]

    eps = [FakeEP(n) for n in ("alpha", "zeta", "beta", "broken")]
    monkeypatch.setattr(mainjob, "entry_points", lambda group: eps)
    steps = mainjob.discover()
    assert [s.name for s in steps] == ["zeta", "alpha", "beta", "broken"]


def test_run_stops_at_the_first_failing_step_and_shares_results() -> None:
    seen: list[str] = []

    async def first(ctx: mainjob.MainJobContext) -> Mapping[str, Any]:
        seen.append("first")
        return {"job_id": "j-1"}

    async def second(ctx: mainjob.MainJobContext) -> Mapping[str, Any]:
        seen.append(ctx.results["first"]["job_id"])
        return {"ok": False, "why": "no event"}

    async def third(ctx: mainjob.MainJobContext) -> Mapping[str, Any]:
        seen.append("third")
        return {}

    steps = [_step("first", first), _step("second", second), _step("third", third)]
    outcomes = asyncio.run(mainjob.run(steps, _ctx(), Console(file=open(os.devnull, "w"))))  # noqa: SIM115
    assert seen == ["first", "j-1"]
    assert [o.ok for o in outcomes] == [True, False]


def test_a_raising_or_misbehaving_step_fails_with_its_error() -> None:
    async def boom(ctx: Any) -> Mapping[str, Any]:
        raise RuntimeError("scheduler said no")

    async def not_a_dict(ctx: Any) -> Any:
        return 42

    quiet = Console(file=open(os.devnull, "w"))  # noqa: SIM115
    (raised,) = asyncio.run(mainjob.run([_step("boom", boom)], _ctx(), quiet))
    assert not raised.ok and "scheduler said no" in raised.error
    (odd,) = asyncio.run(mainjob.run([_step("odd", not_a_dict)], _ctx(), quiet))
    assert not odd.ok and "not a dict" in odd.error


def test_up_fails_when_no_step_is_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mainjob, "discover", lambda group=mainjob.GROUP: [])
    console = Console(record=True, width=200)
    assert asyncio.run(local.run_main(_ctx(), console)) == 1
    assert "no main job step is registered" in console.export_text()


# --- up / down against real processes -----------------------------------------------------------

FAKE_SERVICE = textwrap.dedent(
    '''
    """A minimal Forge service for the CLI's tests: real gRPC health + HTTP /healthz, nothing else."""
    import asyncio

    from forge_kit.grpckit import serve
    from forge_kit.http import HttpServer, make_app
    from forge_kit.runtime import ServiceParts, run_forever
    from forge_kit.settings import ServiceSettings, service_config


    class Settings(ServiceSettings):
        model_config = service_config("fakesvc")


    async def main() -> None:
        s = Settings()
        grpc_server = await serve(service="fakesvc", register=[], service_names=[], host=s.host,
                                  port=s.grpc_port, token=s.auth_token.get_secret_value(),
                                  default_deadline_s=s.default_deadline_s)
        http_server = HttpServer(make_app("fakesvc"), s.host, s.http_port)
        await http_server.start()
        await run_forever(ServiceParts("fakesvc", grpc=grpc_server, http=http_server))


    asyncio.run(main())
    '''
)


@pytest.fixture
def fake_platform(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[supervisor.Paths, Infra, tuple[ServiceSpec, ...]]:
    pkg = tmp_path / "pkgs" / "forge_fakesvc"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(FAKE_SERVICE)
    # The fake package first; then whatever the test run imports from (a worktree's sources).
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path / "pkgs"), os.environ.get("PYTHONPATH")]))
    )
    infra = Infra(
        kafka_port=free_port(),
        temporal_port=free_port(),
        temporal_ui_port=free_port(),
        mlflow_port=free_port(),
    )
    table = (ServiceSpec("fakesvc", grpc_port=free_port(), http_port=free_port()),)
    paths = supervisor.Paths(tmp_path / "root")
    paths.root.mkdir()
    yield paths, infra, table
    local.down(paths, Console(file=open(os.devnull, "w")), table)  # noqa: SIM115


@pytest.mark.integration
def test_up_twice_restart_after_crash_and_down_leaves_nothing(fake_platform: Any) -> None:
    paths, infra, table = fake_platform
    quiet = Console(record=True, width=200)

    async def up() -> int:
        return await local.up(paths, table, quiet, run_main_job=False, infra=infra, table=table, timeout_s=60)

    assert asyncio.run(up()) == 0, quiet.export_text()
    pids = {name: supervisor.read_pid(paths, name) for name in ("tansu", "temporal", "mlflow", "fakesvc")}
    assert all(pids.values())
    assert stat.S_IMODE(paths.tokens.stat().st_mode) == 0o600
    assert "AUTH_TOKEN" not in paths.log_file("fakesvc").read_text()

    # A second `up` keeps everything that is running.
    assert asyncio.run(up()) == 0
    assert {n: supervisor.read_pid(paths, n) for n in pids} == pids

    # A crashed service is restarted; the rest is kept.
    service_pid = pids["fakesvc"]
    assert service_pid is not None
    os.kill(service_pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while supervisor.is_running(service_pid, "forge_fakesvc"):
        assert time.monotonic() < deadline, "the killed service is still running"
        time.sleep(0.05)
    assert asyncio.run(up()) == 0, quiet.export_text()
    assert supervisor.read_pid(paths, "fakesvc") != service_pid
    assert supervisor.read_pid(paths, "tansu") == pids["tansu"]

    # status sees every component healthy.
    assert asyncio.run(local.status(paths, table, quiet, infra)) == 0

    live = [supervisor.read_pid(paths, n) for n in pids]
    assert local.down(paths, quiet, table) == 0
    assert not list(paths.run_dir.glob("*.pid"))
    for pid in live:
        assert pid is not None and not supervisor.group_members(pid)
    for port in (
        infra.kafka_port,
        infra.temporal_port,
        infra.mlflow_port,
        table[0].grpc_port,
        table[0].http_port,
    ):
        assert not port_open(port)
    assert (paths.mlflow_dir / "mlflow.db").exists()


@pytest.mark.integration
def test_up_reports_a_service_that_dies_at_start(fake_platform: Any) -> None:
    paths, infra, table = fake_platform
    os.environ["FORGE_FAKESVC_NO_SUCH_SETTING"] = "1"  # the service rejects it and exits
    try:
        console = Console(record=True, width=200)
        code = asyncio.run(
            local.up(paths, table, console, run_main_job=False, infra=infra, table=table, timeout_s=60)
        )
    finally:
        del os.environ["FORGE_FAKESVC_NO_SUCH_SETTING"]
    assert code == 1
    text = console.export_text()
    assert "fakesvc exited during start-up" in text and "NO_SUCH_SETTING" in text


def _flaky_binder(tmp_path: Path, failure: str) -> supervisor.Component:
    """A component whose first start dies with ``failure`` in its log, and whose later starts
    serve (healthy once the log says so)."""
    tried = tmp_path / "tried"
    script = textwrap.dedent(
        f"""
        import pathlib, sys, time
        tried = pathlib.Path({str(tried)!r})
        if not tried.exists():
            tried.write_text("1")
            print({failure!r}, flush=True)
            for frame in range(40):  # a Go panic's goroutine dump: the failure lies far above the end
                print(f"main.frame{{frame}}(0xc000123456?)\\n\\t/src/main.go:{{frame}} +0x1b9", flush=True)
            sys.exit(1)
        print("serving", flush=True)
        time.sleep(60)
        """
    )
    paths = supervisor.Paths(tmp_path)

    async def healthy() -> bool:
        log = paths.log_file("binder")
        return log.exists() and log.read_text().rstrip().endswith("serving")

    return supervisor.Component(
        name="binder", argv=[sys.executable, "-c", script, "forge_binder_test"], marker="forge_binder_test",
        health=healthy,
    )  # fmt: skip


@pytest.mark.parametrize(
    "failure",
    [
        "RuntimeError: Failed to bind to address 127.0.0.1:50054",
        # Temporal's dev server, when a free port it picked for an internal service was taken
        "panic: failed assigning ephemeral port: listen tcp 127.0.0.1:41235: bind: address in use",
    ],
)
def test_a_service_whose_port_was_taken_at_bind_is_started_again(tmp_path: Path, failure: str) -> None:
    """Forge's ports lie in Linux's ephemeral range: another process's outgoing connection can
    hold one at the moment a service binds. That start is retried; any other exit is not."""
    paths = supervisor.Paths(tmp_path)
    binder = _flaky_binder(tmp_path, failure)
    (started,) = asyncio.run(local.bring_up([binder], paths, timeout_s=30))
    try:
        assert supervisor.is_running(started.pid, "forge_binder_test")
        assert supervisor.read_pid(paths, "binder") == started.pid
        assert paths.log_file("binder").read_text().count(supervisor.START_BANNER) == 2
    finally:
        supervisor.stop({"binder": started.pid}, timeout_s=5)

    other = tmp_path / "other"
    other.mkdir()
    crasher = _flaky_binder(other, "ValueError: NO_SUCH_SETTING")
    with pytest.raises(local.UpFailed, match="binder exited during start-up"):
        asyncio.run(local.bring_up([crasher], supervisor.Paths(other), timeout_s=30))
    panicker = other / "panicker"
    panicker.mkdir()
    with pytest.raises(local.UpFailed, match="reported 'panic: runtime error: nil map'"):
        asyncio.run(
            local.bring_up(
                [_flaky_binder(panicker, "panic: runtime error: nil map")],
                supervisor.Paths(panicker),
                timeout_s=30,
            )
        )
    assert supervisor.Paths(other).log_file("binder").read_text().count(supervisor.START_BANNER) == 1


@pytest.mark.integration
def test_forge_command_up_and_down_with_no_services(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "FORGE_ROOT": str(tmp_path),
        "FORGE_LOCAL_KAFKA_PORT": str(free_port()),
        "FORGE_LOCAL_TEMPORAL_PORT": str(free_port()),
        "FORGE_LOCAL_TEMPORAL_UI_PORT": str(free_port()),
        "FORGE_LOCAL_MLFLOW_PORT": str(free_port()),
    }
    forge = [sys.executable, "-c", "from forge_cli.main import app; app()"]
    try:
        up = subprocess.run(
            [*forge, "up", "--services", "", "--no-main-job"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert up.returncode == 0, up.stdout + up.stderr
        assert "tansu" in up.stdout and "temporal" in up.stdout and "mlflow" in up.stdout
        status = subprocess.run(
            [*forge, "status", "--services", "", "--check"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stdout
    finally:
        down = subprocess.run([*forge, "down"], env=env, capture_output=True, text=True, timeout=60)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not list((tmp_path / "var" / "run").glob("*.pid"))
    assert not port_open(int(env["FORGE_LOCAL_KAFKA_PORT"]))
    assert not port_open(int(env["FORGE_LOCAL_MLFLOW_PORT"]))
