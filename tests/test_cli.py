"""The `forge` command: help, tokens, the platform table's environment, the main job, up/down."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Mapping
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from forge_cli import local, mainjob, platform, plugins, supervisor, tokens
from forge_cli.main import app
from forge_cli.platform import Infra, ServiceSpec, grpc, http
from forge_kit.testing.processes import free_port, port_open

runner = CliRunner()


# --- help and plugins ---------------------------------------------------------------------------


def test_help_lists_the_platform_commands() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0, result.output
    for command in ("up", "down", "status"):
        assert command in result.output


def test_a_plugin_that_fails_to_import_does_not_break_help(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = EntryPoint(name="brokenthing", value="forge_no_such_module.cli:app", group=plugins.GROUP)
    monkeypatch.setattr(plugins, "plugin_entry_points", lambda group=plugins.GROUP: {"brokenthing": broken})
    listing = runner.invoke(app, ["--help"])
    assert listing.exit_code == 0, listing.output
    assert "brokenthing" in listing.output and "up" in listing.output
    used = runner.invoke(app, ["brokenthing"])
    assert used.exit_code == 1
    assert "forge_no_such_module" in used.output


def test_a_plugin_typer_app_becomes_a_subcommand(monkeypatch: pytest.MonkeyPatch) -> None:
    ep = EntryPoint(name="demo", value="tests_cli_demo_plugin:app", group=plugins.GROUP)
    import types

    import typer

    demo = typer.Typer()

    @demo.command()
    def hello(name: str) -> None:
        typer.echo(f"hello {name}")

    @demo.command()
    def bye() -> None:
        typer.echo("bye")

    module = types.ModuleType("tests_cli_demo_plugin")
    module.app = demo  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tests_cli_demo_plugin", module)
    monkeypatch.setattr(plugins, "plugin_entry_points", lambda group=plugins.GROUP: {"demo": ep})
    result = runner.invoke(app, ["demo", "hello", "forge"])
    assert result.exit_code == 0, result.output
    assert "hello forge" in result.output


def test_two_packages_sharing_a_subcommand_name_merge(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    import typer

    first, second = typer.Typer(), typer.Typer()

    @first.command()
    def run() -> None:
        typer.echo("ran")

    @first.command()
    def compare() -> None:
        typer.echo("compared")

    @second.command()
    def retrieval() -> None:
        typer.echo("retrieved")

    for module_name, typer_app in (("tests_cli_eval_a", first), ("tests_cli_eval_b", second)):
        module = types.ModuleType(module_name)
        module.app = typer_app  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, module_name, module)
    eps = [
        EntryPoint(name="evalx", value="tests_cli_eval_a:app", group=plugins.GROUP),
        EntryPoint(name="evalx", value="tests_cli_eval_b:app", group=plugins.GROUP),
    ]
    monkeypatch.setattr(plugins, "plugin_entry_points", lambda group=plugins.GROUP: {"evalx": eps})
    for args, expected in ((["evalx", "run"], "ran"), (["evalx", "retrieval"], "retrieved")):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        assert expected in result.output


def test_help_shows_one_line_per_command_group() -> None:
    """The installed plugins, as a user sees them: each group on one line of its own, a group two
    packages share described once (its main package's help, then what the other adds)."""
    result = runner.invoke(app, ["--help"], env={"COLUMNS": "400"}, terminal_width=400)
    assert result.exit_code == 0, result.output
    lines = {}
    for line in result.output.splitlines():
        cells = line.strip("│ ").split(None, 1)
        if len(cells) == 2:
            lines.setdefault(cells[0], cells[1].strip("│ "))
    for group, entry_points in plugins.plugin_entry_points().items():
        assert group in lines, f"{group} missing from forge --help"
        assert not lines[group].startswith("(broken plugin)"), lines[group]
        assert lines[group].endswith("."), lines[group]
        if len(entry_points) > 1:
            assert "Also: " in lines[group], lines[group]
    assert lines["eval"] == "Run benchmark tasks, compare runs and apply the release gate. Also: retrieval."
    assert lines["bench"] == "Training benchmarks: step throughput and the recipe chain. Also: engine."


def test_a_merged_group_is_described_by_the_plugin_with_most_commands() -> None:
    import typer

    small, big = (
        typer.Typer(help="Inference engine benchmark."),
        typer.Typer(help="Training benchmarks.\n\nLong text."),
    )

    @small.command()
    def engine() -> None: ...

    @big.command()
    def train() -> None: ...

    @big.command()
    def recipes() -> None: ...

    merged = plugins._merged("bench", [typer.main.get_command(small), typer.main.get_command(big)])
    assert merged.help == "Training benchmarks. Also: engine."
    assert set(merged.commands) == {"engine", "train", "recipes"}


def test_an_expected_failure_in_any_command_is_one_line_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import types

    import typer

    broken = typer.Typer()

    @broken.command()
    def wait() -> None:
        raise TimeoutError("workflow w-1 still RUNNING after 300s")

    module = types.ModuleType("tests_cli_timeout")
    module.app = broken  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tests_cli_timeout", module)
    eps = [EntryPoint(name="waitx", value="tests_cli_timeout:app", group=plugins.GROUP)]
    monkeypatch.setattr(plugins, "plugin_entry_points", lambda group=plugins.GROUP: {"waitx": eps})
    result = runner.invoke(app, ["waitx"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.strip() == "forge: error: timed out: workflow w-1 still RUNNING after 300s"


def test_a_service_that_is_not_up_is_one_line() -> None:
    """The real ``forge workflows get`` against a port nothing listens on."""
    port = free_port()
    result = runner.invoke(
        app,
        ["workflows", "get", "w-1", "--target", f"127.0.0.1:{port}"],
        env={"FORGE_CLI_ORCHESTRATOR_TOKEN": "t"},
    )
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert "UNAVAILABLE" in result.output and "is the service up?" in result.output
    assert len(result.output.strip().splitlines()) == 1


def _replay_on_a_terminal(tmp_path: Path, *extra: str) -> tuple[int, str, str]:
    """``forge sim replay`` with stderr on a pseudo-terminal (as a user sees it) and stdout piped."""
    import pty

    trace = tmp_path / "trace.csv"
    trace.write_text(
        "submit_time,duration_s,num_gpus,team\n" + "".join(f"{i},{30 + i},1,t{i % 2}\n" for i in range(20))
    )
    primary, secondary = pty.openpty()
    command = [sys.executable, "-c", "from forge_cli.main import app; app()", "sim", "replay"]
    command += [
        "--trace",
        str(trace),
        "--gpus",
        "4",
        "--gpus-per-node",
        "4",
        "--policies",
        "fifo",
        "--workers",
        "1",
    ]
    command += ["--out", str(tmp_path / "out"), *extra]
    env = {**os.environ, "COLUMNS": "120", "TERM": "xterm"}
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=secondary, env=env) as proc:
        os.close(secondary)
        terminal = b""
        while True:
            try:
                chunk = os.read(primary, 4096)
            except OSError:  # the child closed its end
                break
            if not chunk:
                break
            terminal += chunk
        stdout = proc.stdout.read().decode() if proc.stdout else ""
    os.close(primary)
    return proc.returncode, stdout, terminal.decode(errors="replace")


def test_a_long_command_draws_progress_on_a_terminal_and_keeps_stdout_clean(tmp_path: Path) -> None:
    code, stdout, terminal = _replay_on_a_terminal(tmp_path)
    assert code == 0, terminal
    assert "replaying 20 jobs" in terminal and "1/1" in terminal
    assert json.loads(stdout)["policies"]["fifo"]["makespan_s"] > 0  # nothing but JSON on stdout
    quiet_code, quiet_stdout, quiet_terminal = _replay_on_a_terminal(tmp_path, "--quiet")
    assert quiet_code == 0 and "replaying" not in quiet_terminal
    assert json.loads(quiet_stdout) == json.loads(stdout)


def test_progress_is_off_when_stderr_is_not_a_terminal(tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text("submit_time,duration_s,num_gpus,team\n0,10,1,a\n1,10,1,b\n")
    command = [sys.executable, "-c", "from forge_cli.main import app; app()", "sim", "replay"]
    command += [
        "--trace",
        str(trace),
        "--gpus",
        "2",
        "--gpus-per-node",
        "2",
        "--policies",
        "fifo",
        "--workers",
        "1",
    ]
    done = subprocess.run(
        [*command, "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "replaying" not in done.stderr and json.loads(done.stdout)


# --- tokens -------------------------------------------------------------------------------------


def test_tokens_are_private_stable_and_grow_with_new_services(tmp_path: Path) -> None:
    path = tmp_path / "var" / "secrets" / "tokens.json"
    first = tokens.load_or_create(path, ["scheduler", "eval"])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert first["scheduler"] != first["eval"] and len(first["scheduler"]) >= 32
    again = tokens.load_or_create(path, ["scheduler", "eval"])
    assert again == first
    grown = tokens.load_or_create(path, ["scheduler", "eval", "retriever"])
    assert grown["scheduler"] == first["scheduler"] and "retriever" in grown
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_token_file_with_loose_permissions_is_tightened(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    tokens.load_or_create(path, ["scheduler"])
    path.chmod(0o644)
    tokens.load_or_create(path, ["scheduler"])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


# --- the platform table -------------------------------------------------------------------------

TABLE = (
    ServiceSpec("alpha", grpc_port=1001, http_port=2001),
    ServiceSpec("beta", grpc_port=1002, http_port=2002, calls=(grpc("alpha"),)),
    ServiceSpec(
        "gamma",
        grpc_port=1003,
        http_port=2003,
        calls=(http("beta"), grpc("alpha")),
        temporal=True,
        extra={"model_dir": "{root}/var/models"},
    ),
)
TOKENS = {"alpha": "tok-a", "beta": "tok-b", "gamma": "tok-g"}
EVENT_KEYS = {name: tokens.new_event_key() for name in TOKENS}
SECRETS: dict[str, Any] = {"event_keys": EVENT_KEYS, "generated": {}}


def test_env_has_exactly_the_declared_keys_of_each_service() -> None:
    root = Path("/repo")
    for spec in TABLE:
        env = platform.service_env(spec, TABLE, TOKENS, root, **SECRETS)
        assert sorted(env) == sorted(spec.prefix + key for key in platform.declared_keys(spec))
        assert all(key.startswith(spec.prefix) for key in env)


def test_env_wires_targets_urls_and_only_the_callees_tokens() -> None:
    infra = Infra(kafka_port=9999, temporal_port=7777)
    env = platform.service_env(TABLE[2], TABLE, TOKENS, Path("/repo"), infra, **SECRETS)
    assert env["FORGE_GAMMA_AUTH_TOKEN"] == "tok-g"
    assert env["FORGE_GAMMA_BETA_URL"] == "http://127.0.0.1:2002"
    assert env["FORGE_GAMMA_BETA_TOKEN"] == "tok-b"
    assert env["FORGE_GAMMA_ALPHA_TARGET"] == "127.0.0.1:1001"
    assert env["FORGE_GAMMA_ALPHA_TOKEN"] == "tok-a"
    assert env["FORGE_GAMMA_TEMPORAL_TARGET"] == "127.0.0.1:7777"
    assert env["FORGE_GAMMA_KAFKA_BOOTSTRAP"] == "127.0.0.1:9999"
    assert env["FORGE_GAMMA_DATA_DIR"] == "/repo/var/data/gamma"
    assert env["FORGE_GAMMA_OBJECT_STORE_URL"] == "/repo/var/objects"
    assert env["FORGE_GAMMA_MODEL_DIR"] == "/repo/var/models"
    leaf = platform.service_env(TABLE[0], TABLE, TOKENS, Path("/repo"), **SECRETS)
    assert "tok-b" not in leaf.values() and "tok-g" not in leaf.values()


def test_a_tracking_service_gets_the_mlflow_server() -> None:
    spec = ServiceSpec("delta", grpc_port=1004, http_port=2004, tracking=True)
    secrets = {"event_keys": {**EVENT_KEYS, "delta": tokens.new_event_key()}, "generated": {}}
    table = (*TABLE, spec)
    env = platform.service_env(
        spec, table, {**TOKENS, "delta": "tok-d"}, Path("/repo"), Infra(mlflow_port=8123), **secrets
    )
    assert env["FORGE_DELTA_MLFLOW_URI"] == "http://127.0.0.1:8123"
    assert "MLFLOW_URI" in platform.declared_keys(spec)
    assert "FORGE_GAMMA_MLFLOW_URI" not in platform.service_env(
        TABLE[2], TABLE, TOKENS, Path("/repo"), **SECRETS
    )


def test_the_real_table_is_consistent() -> None:
    assert platform.validate(platform.SERVICES) == []
    assert {s.name for s in platform.SERVICES} == {
        "scheduler",
        "trainer_agent",
        "model_server",
        "inference_gateway",
        "retriever",
        "reranker",
        "eval",
        "preference_feedback",
        "orchestrator",
    }


def test_validate_names_the_problem() -> None:
    bad = (*TABLE, ServiceSpec("delta", grpc_port=1001, http_port=2004, calls=(grpc("nobody"),)))
    problems = platform.validate(bad)
    assert "port 1001 used twice" in problems
    assert "delta calls unknown service 'nobody'" in problems


def test_select_rejects_unknown_services() -> None:
    assert platform.select([""]) == ()
    assert [s.name for s in platform.select(["eval", "scheduler"])] == ["scheduler", "eval"]
    with pytest.raises(ValueError, match="nope"):
        platform.select(["nope"])


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
    deadline = time.monotonic() + 5
    while supervisor.is_running(service_pid, "forge_fakesvc") and time.monotonic() < deadline:
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


def test_a_service_whose_port_was_taken_at_bind_is_started_again(tmp_path: Path) -> None:
    """Forge's ports lie in Linux's ephemeral range: another process's outgoing connection can
    hold one at the moment a service binds. That start is retried; any other exit is not."""
    paths = supervisor.Paths(tmp_path)
    binder = _flaky_binder(tmp_path, "RuntimeError: Failed to bind to address 127.0.0.1:50054")
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


# --- the table against the services' own settings classes ---------------------------------------

# Fields that name an address but are not calls between Forge services: every service's
# (forge_kit.settings.ServiceSettings) infrastructure, and the retriever's optional Qdrant server
# (QDRANT_URL; empty = the embedded Qdrant Edge).
NOT_CALLS = {"DATABASE_URL", "REDIS_URL", "OBJECT_STORE_URL", "QDRANT_URL"}


def _settings_fields(spec: ServiceSpec) -> set[str] | None:
    """Upper-case field names of the service's settings class, or None if it is not installed."""
    import importlib
    import inspect

    from forge_kit.settings import ServiceSettings

    try:
        module = importlib.import_module(f"{spec.module}.config")
    except ModuleNotFoundError:
        return None
    classes = [
        c
        for _, c in inspect.getmembers(module, inspect.isclass)
        if issubclass(c, ServiceSettings) and c is not ServiceSettings and c.__module__ == module.__name__
    ]
    assert len(classes) == 1, f"{spec.module}.config should define one settings class, found {classes}"
    return {name.upper() for name in classes[0].model_fields}


@pytest.mark.parametrize("spec", platform.SERVICES, ids=lambda s: s.name)
def test_table_matches_the_service_settings(spec: ServiceSpec) -> None:
    """What `forge up` passes must be declared (or the service refuses to start), and every
    `<target>_target` / `<target>_url` the service declares must be wired by the table."""
    fields = _settings_fields(spec)
    if fields is None:
        pytest.skip(f"{spec.module} is not installed")
    declared = set(platform.declared_keys(spec))
    assert declared - fields == set(), "the table passes settings the service does not declare"
    addresses = {f for f in fields if f.endswith(("_TARGET", "_URL")) and f not in NOT_CALLS}
    assert addresses - declared == set(), "the service declares addresses the table does not wire"


def test_the_cli_fails_in_one_line_on_a_bad_mirror(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORGE_DATA_DIR", str(tmp_path / "data"))
    mirror = tmp_path / "mirror" / "corpora" / "tinyshakespeare"
    mirror.mkdir(parents=True)
    (mirror / "input.txt").write_text("not shakespeare")
    result = CliRunner().invoke(app, ["data", "fetch", "tinyshakespeare", "--from", str(tmp_path / "mirror")])
    assert result.exit_code == 1
    assert "checksum mismatch for input.txt" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "data" / "corpora" / "tinyshakespeare" / "input.txt").exists()
