"""Detached processes with pid files: start what is missing, find what runs, stop everything.

``forge up`` must return while the platform keeps running, and a later ``forge up`` / ``forge
down`` / ``forge status`` (another process) must find it again. So every component runs in its own
session (``setsid``: its pid is also its process-group id, and a terminal's Ctrl-C does not reach
it), its pid is written to ``var/run/<name>.pid`` and its output appended to ``var/log/<name>.log``.

A pid file alone is not trusted: pids are reused. A pid counts as ours only while that process is
alive (not a zombie), still leads its own session, and its command line contains the component's
marker (the module or binary name).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from forge_kit.paths import private_dir

HealthCheck = Callable[[], Awaitable[bool]]


@dataclass(frozen=True)
class Paths:
    """Where the local platform keeps its state: everything under ``<root>/var``."""

    root: Path

    @property
    def var(self) -> Path:
        return self.root / "var"

    @property
    def run_dir(self) -> Path:
        return self.var / "run"

    @property
    def log_dir(self) -> Path:
        return self.var / "log"

    @property
    def tokens(self) -> Path:
        return self.var / "secrets" / "tokens.json"

    @property
    def event_keys(self) -> Path:
        return self.var / "secrets" / "event_keys.json"

    @property
    def generated(self) -> Path:
        return self.var / "secrets" / "generated.json"

    @property
    def objects(self) -> Path:
        return self.var / "objects"

    @property
    def temporal_db(self) -> Path:
        return self.var / "temporal" / "dev.db"

    @property
    def mlflow_dir(self) -> Path:
        """The MLflow server's SQLite store (``mlflow.db``) and artifacts (``artifacts/``)."""
        return self.var / "mlflow"

    def pid_file(self, name: str) -> Path:
        return self.run_dir / f"{name}.pid"

    def log_file(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def data_dir(self, name: str) -> Path:
        return self.var / "data" / name


@dataclass
class Component:
    """One process of the platform and how to tell that it works."""

    name: str
    argv: list[str]
    marker: str
    """Substring of the command line that identifies this process (guards against pid reuse)."""
    health: HealthCheck
    ports: tuple[int, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    urls: tuple[str, ...] = ()


_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}
"""Processes this command started: polled so that one that dies early is reaped, not a zombie."""


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name, or None if there is no such process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rfind(")") + 2 :].split()


def is_running(pid: int, marker: str | None = None) -> bool:
    """True when ``pid`` is a live session leader whose command line contains ``marker``."""
    child = _CHILDREN.get(pid)
    if child is not None:
        # Started by this process: poll() is exact and reaps it if it died. The command line is
        # not consulted, as it reads empty for a moment while the child is still inside execve().
        return child.poll() is None
    fields = _proc_stat(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return False
    session = int(fields[3])
    if session != pid:
        return False
    if marker is None:
        return True
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return marker in cmdline


def group_members(pgid: int) -> list[int]:
    """Live processes in process group ``pgid`` (children a component started count too)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _proc_stat(int(entry.name))
        if fields is not None and fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def read_pid(paths: Paths, name: str) -> int | None:
    try:
        return int(paths.pid_file(name).read_text().strip())
    except (OSError, ValueError):
        return None


def live_pid(paths: Paths, name: str, marker: str | None) -> int | None:
    """The component's pid if its pid file names a process that is still ours, else None."""
    pid = read_pid(paths, name)
    return pid if pid is not None and is_running(pid, marker) else None


START_BANNER = "--- forge: starting"
"""The line :func:`spawn` writes to a component's log before each start."""


def spawn(component: Component, paths: Paths) -> int:
    """Start ``component`` detached in its own session; record its pid; return it."""
    private_dir(paths.run_dir)
    private_dir(paths.log_dir)  # logs carry audit entries and request details
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **component.env}
    with open(paths.log_file(component.name), "ab") as log:
        log.write(f"\n{START_BANNER} {component.name} at {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            component.argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=paths.root,
            start_new_session=True,
        )
    _CHILDREN[proc.pid] = proc
    pid_file = paths.pid_file(component.name)
    tmp = pid_file.with_suffix(".pid.tmp")
    tmp.write_text(f"{proc.pid}\n")
    os.replace(tmp, pid_file)
    return proc.pid


def log_tail(paths: Paths, name: str, lines: int = 20) -> str:
    """The last ``lines`` lines of a component's log, for error messages."""
    try:
        text = paths.log_file(name).read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


#: How much of a log :func:`last_start_log` reads back, at most: a Go panic's goroutine dump
#: runs to hundreds of lines, far past what :func:`log_tail` shows.
LAST_START_BYTES = 256 * 1024


def last_start_log(paths: Paths, name: str) -> str:
    """What a component wrote since its latest start (:data:`START_BANNER`): its last
    :data:`LAST_START_BYTES` at most."""
    try:
        with open(paths.log_file(name), "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - LAST_START_BYTES))
            text = log.read().decode(errors="replace")
    except OSError:
        return ""
    return text.rsplit(START_BANNER, 1)[-1]


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def stop(pids: Mapping[str, int], timeout_s: float = 20.0) -> dict[str, str]:
    """SIGTERM each process group, wait, SIGKILL what is left; returns ``name -> how it ended``.

    Groups are signalled together so that shutdown takes one timeout, not one per component.
    A component is done only when no process of its group is left, not just its leader.
    """
    outcome: dict[str, str] = {}
    for pid in pids.values():
        _signal_group(pid, signal.SIGTERM)
    pending = dict(pids)
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        for name, pid in list(pending.items()):
            if not group_members(pid):
                outcome[name] = "stopped"
                del pending[name]
        time.sleep(0.1)
    for name, pid in pending.items():
        _signal_group(pid, signal.SIGKILL)
        outcome[name] = "killed"
    deadline = time.monotonic() + 5.0
    while any(group_members(pid) for pid in pending.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    for name, pid in pending.items():
        if group_members(pid):
            outcome[name] = f"still running (pgid {pid})"
    return outcome


def pid_file_names(paths: Paths) -> list[str]:
    """Components that have a pid file, whether or not they are in the current table."""
    if not paths.run_dir.exists():
        return []
    return sorted(p.stem for p in paths.run_dir.glob("*.pid"))


def remove_pid_files(paths: Paths, names: Iterable[str]) -> None:
    for name in names:
        paths.pid_file(name).unlink(missing_ok=True)
