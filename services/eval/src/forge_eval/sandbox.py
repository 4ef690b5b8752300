"""Running untrusted generated code (HumanEval): a subprocess with time, memory and process
limits, an empty temporary working directory, an empty environment and no network.

Why a subprocess and not ``exec``: generated code can loop forever, allocate without bound, fork,
delete files or open sockets. Here it runs in a fresh interpreter (``-I``: isolated mode, no user
site, no environment variables), in a new session so the whole process group is killed on
timeout, under ``RLIMIT_AS``/``RLIMIT_CPU``/``RLIMIT_NPROC``/``RLIMIT_FSIZE``, and inside a new
network namespace (``unshare -rn``: only a down loopback) where the host allows user namespaces;
where it does not, a guard installed before the code runs makes every socket call raise.
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from forge_kit import spawn

_GUARD = """\
import socket as _s
def _no_network(*a, **k):
    raise OSError("network access is disabled in the eval sandbox")
for _name in ("socket", "create_connection", "getaddrinfo", "socketpair", "fromfd"):
    setattr(_s, _name, _no_network)
del _s, _name
"""


@dataclass(frozen=True)
class SandboxResult:
    """How one program ended: ``passed`` only when it exited 0 within its limits."""

    passed: bool
    status: str
    output: str


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0
    memory_bytes: int = 1 << 30
    max_processes: int = 64
    max_file_bytes: int = 1 << 24


@functools.cache
def network_namespace_available() -> bool:
    """Whether ``unshare -rn`` works here (it needs unprivileged user namespaces)."""
    tool = shutil.which("unshare")
    if tool is None:
        return False
    try:
        return subprocess.run([tool, "-rn", "true"], capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def run_program(source: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``source`` as a Python program in the sandbox and say whether it succeeded."""
    cpu = int(limits.timeout_s) + 1
    # RLIMIT_NPROC counts the user's processes, so it caps a fork bomb, not honest code.
    soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    nproc = limits.max_processes + len(os.listdir("/proc")) if soft == resource.RLIM_INFINITY else soft
    rlimits = {
        "AS": (limits.memory_bytes, limits.memory_bytes),
        "CPU": (cpu, cpu),
        "FSIZE": (limits.max_file_bytes, limits.max_file_bytes),
        "CORE": (0, 0),
        "NPROC": (min(nproc, hard), hard),
    }

    with tempfile.TemporaryDirectory(prefix="forge-eval-sandbox-") as workdir:
        script = os.path.join(workdir, "program.py")
        with open(script, "w") as handle:
            handle.write(_GUARD + source)
        command = [sys.executable, "-I", "-B", script]
        if network_namespace_available():
            command = ["unshare", "-rn", *command]
        try:
            proc = subprocess.Popen(
                spawn.command(command, rlimits=rlimits),
                cwd=workdir,
                env={"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            return SandboxResult(False, "error", repr(exc))
        try:
            out, _ = proc.communicate(timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return SandboxResult(False, "timeout", "")
        text = out.decode(errors="replace")[-2000:]
        if proc.returncode == 0:
            return SandboxResult(True, "passed", text)
        if proc.returncode < 0:
            return SandboxResult(False, f"killed by {signal.Signals(-proc.returncode).name}", text)
        return SandboxResult(False, "failed", text)
