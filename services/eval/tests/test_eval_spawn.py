"""forge_eval.spawn: limits and the parent-death signal are set in the child, then the command runs."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from forge_eval import spawn


def test_the_command_runs_under_the_limits_with_its_own_arguments() -> None:
    probe = "import resource, sys; print(resource.getrlimit(resource.RLIMIT_NOFILE), sys.argv[1:])"
    argv = spawn.command([sys.executable, "-c", probe, "--parent", "x"], rlimits={"NOFILE": (64, 128)})
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "(64, 128) ['--parent', 'x']"


def test_unknown_limits_and_empty_commands_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown resource limit 'BOGUS'"):
        spawn.command(["true"], rlimits={"BOGUS": (1, 1)})
    with pytest.raises(ValueError, match="argv is empty"):
        spawn.command([])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_child_dies_with_its_parent(tmp_path) -> None:
    pid_file = tmp_path / "child.pid"
    # The parent (a short Python) starts a long sleeper through spawn and exits at once.
    parent = (
        "import subprocess, sys; from forge_eval import spawn; "
        f"p = subprocess.Popen(spawn.command(['sh', '-c', 'echo $$ > {pid_file}; exec sleep 60'],"
        " die_with_parent=True)); "
        "import time\n"
        f"while not __import__('pathlib').Path({str(pid_file)!r}).exists(): time.sleep(0.01)\n"
    )
    subprocess.run([sys.executable, "-c", parent], check=True, timeout=30)
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if not _alive(child):
            return
        time.sleep(0.05)
    subprocess.run(["kill", "-9", str(child)], check=False)
    pytest.fail("the child outlived its parent")


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for an init that may not reap it."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_an_orphan_does_not_start() -> None:
    """A parent already gone before the child tied itself to it: the command never runs."""
    result = subprocess.run(
        [sys.executable, "-m", "forge_eval.spawn", "--parent", "1", "--", "echo", "ran"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == spawn.ORPHANED_EXIT and "ran" not in result.stdout
