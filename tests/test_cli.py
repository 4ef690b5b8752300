"""The `forge` command: help, plugins, one-line errors, progress on a terminal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
from typer.testing import CliRunner

from forge_cli import plugins
from forge_cli.main import app
from forge_kit import clitools
from forge_kit.testing.processes import free_port

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
    assert lines["bench"] == "Benchmarks: one a package declares in the entry-point group forge.bench."


def test_forge_bench_lists_every_benchmark_a_package_declares() -> None:
    """``forge bench`` is built from the ``forge.bench`` entry points of the installed packages
    (training, the gateway, the model server), none of them imported by the CLI itself."""
    result = runner.invoke(app, ["bench", "--help"], env={"COLUMNS": "400"}, terminal_width=400)
    assert result.exit_code == 0, result.output
    listed = {line.strip("│ ").split(None, 1)[0]: line for line in result.output.splitlines() if "│ " in line}
    expected = {"train", "recipes", "sweep", "cpt", "vlm", "synthetic", "canary", "serving", "engine"}
    assert expected <= set(listed), result.output
    assert not [name for name in expected if "broken plugin" in listed[name]], result.output
    assert set(clitools.group_entry_points(clitools.BENCH_GROUP)) >= expected


def test_a_benchmark_that_fails_to_import_is_a_stub_and_the_others_still_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    eps = {
        "ok": EntryPoint("ok", "forge_kit.clitools:one_line_for_test", clitools.BENCH_GROUP),
        "gone": EntryPoint("gone", "forge_no_such_package.bench:run", clitools.BENCH_GROUP),
    }
    monkeypatch.setattr(clitools, "one_line_for_test", lambda: print("benchmarked"), raising=False)
    monkeypatch.setattr(clitools, "group_entry_points", lambda group, distribution=None: eps)
    result = runner.invoke(app, ["bench", "ok"])
    assert result.exit_code == 0 and "benchmarked" in result.output, result.output
    broken = runner.invoke(app, ["bench", "gone"])
    assert broken.exit_code == 1
    assert "cannot load forge_no_such_package.bench:run" in broken.output


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
