"""Running untrusted Python (HumanEval completions, program-of-thought solutions) under
bubblewrap, or not at all.

What a program sees: a root file system of its own with nothing of the host but the Python
runtime (the interpreter, its standard library without ``site-packages``, and the shared libraries
they load), bound read-only; a private tmpfs ``/tmp`` and working directory ``/sandbox`` holding
only ``program.py``; a minimal ``/dev``; no ``/proc``, no ``/etc``, no environment variables. It
runs in new PID, network, IPC, UTS and cgroup namespaces (no host unix socket is reachable: the
file system holds none; the network namespace has only its own loopback) under ``RLIMIT_NPROC``,
``RLIMIT_AS``, ``RLIMIT_CPU``, ``RLIMIT_FSIZE`` and ``RLIMIT_NOFILE``, with no capabilities and
no-new-privileges, as an unprivileged host uid:

- this process is root: bwrap runs without a user namespace (one would map the sandbox to host
  root) keeping only CAP_SETUID/CAP_SETGID, and the launcher drops to ``uid``/``gid`` before the
  program starts, so a root-only file stays unreadable even if bound in. ``RLIMIT_NPROC`` then
  counts every task of that host uid; the tasks it already has are added to the allowance.
- otherwise: a user namespace maps the sandbox to this process's own uid, nested user namespaces
  are disabled, and ``RLIMIT_NPROC`` counts this sandbox's tasks only.

On timeout the outer bwrap is killed; its PID-1 reaper dies with it (``--die-with-parent``) and
the kernel kills everything else in the PID namespace, ``setsid()`` children included. If this
process dies, ``setpriv --pdeathsig`` takes bwrap down too.

Where bubblewrap is missing or cannot create the namespaces, :func:`run_python` raises
:class:`SandboxUnavailableError`: code never runs unsandboxed.

The host provides ``bwrap`` (Debian ``bubblewrap``; ``FORGE_SANDBOX_BWRAP``) and util-linux
``setpriv``, unprivileged user namespaces when this process is not root, and when it is, a uid/gid
to drop to (``FORGE_SANDBOX_UID``/``FORGE_SANDBOX_GID``, default ``nobody``) that owns no files;
the Python runtime must be readable by that uid once bound (it need not reach its folder).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from forge_kit import errors
from forge_kit.settings import ForgeSettings

#: Where the program and its scratch files live inside the sandbox.
WORKDIR = "/sandbox"
_PROGRAM = f"{WORKDIR}/program.py"
#: Runs first inside the sandbox: sets the limits, drops root to the sandbox uid (when bwrap ran
#: as root), then the program replaces it.
_LAUNCHER = """\
import os, resource, sys
for spec in sys.argv[1].split(","):
    name, value = spec.split("=")
    resource.setrlimit(getattr(resource, "RLIMIT_" + name), (int(value), int(value)))
if sys.argv[2] != "-":
    uid, gid = (int(x) for x in sys.argv[2].split(":"))
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if 0 in os.getresuid() + os.getresgid():
        raise SystemExit("the sandbox could not drop root")
os.execv(sys.executable, [sys.executable, "-I", "-B", sys.argv[3]])
"""
_OUTPUT_TAIL = 2000


class SandboxSettings(ForgeSettings):
    """Where bubblewrap is and whom sandboxed programs run as (env prefix ``FORGE_SANDBOX_``)."""

    model_config = SettingsConfigDict(
        env_prefix="FORGE_SANDBOX_", extra="forbid", use_attribute_docstrings=True, frozen=True
    )

    bwrap: str = "/usr/bin/bwrap"
    """The bubblewrap binary; a missing one makes code execution refuse to run."""

    setpriv: str = "/usr/bin/setpriv"
    """util-linux ``setpriv``: sets no-new-privileges and the parent-death signal before
    exec'ing bubblewrap."""

    uid: int = Field(default=65534, ge=1, le=2**32 - 2)
    """Host uid programs run as when this process is root (never 0); give it nothing else: its
    processes share one ``RLIMIT_NPROC`` count. Otherwise the uid shown inside the sandbox."""

    gid: int = Field(default=65534, ge=1, le=2**32 - 2)
    """Host gid programs run as when this process is root (never 0)."""


class SandboxUnavailableError(errors.ForgeError):
    """No sandbox can be had here (no bubblewrap, or no user namespaces): untrusted code is refused."""


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
    max_open_files: int = 256
    tmpfs_bytes: int = 1 << 26


def _chain(path: str) -> tuple[str, list[tuple[str, str]]]:
    """The real path of ``path`` and every symbolic link met on the way, as (link, target)."""
    links: list[tuple[str, str]] = []
    pending = [p for p in path.split("/") if p]
    current = "/"
    for _ in range(256):
        if not pending:
            return current, links
        part = pending.pop(0)
        if part == ".":
            continue
        if part == "..":
            current = os.path.dirname(current)
            continue
        candidate = os.path.join(current, part)
        if os.path.islink(candidate):
            target = os.readlink(candidate)
            links.append((candidate, target))
            pending = [p for p in target.split("/") if p] + pending
            if target.startswith("/"):
                current = "/"
        else:
            current = candidate
    raise OSError(f"too many symbolic links resolving {path}")


def _shared_libraries(files: Sequence[str]) -> set[str]:
    """Every shared library (and the dynamic loader) that ``files`` load, from ``ldd``."""
    out = subprocess.run(["ldd", *files], capture_output=True, text=True, timeout=60, check=False).stdout
    found = set()
    for line in out.splitlines():
        words = line.split()
        if (
            "=>" in words
            and len(words) > words.index("=>") + 1
            and words[words.index("=>") + 1].startswith("/")
        ):
            found.add(words[words.index("=>") + 1])
        elif words and words[0].startswith("/") and not words[0].endswith(":"):
            found.add(words[0])
    return found


@dataclass(frozen=True)
class _Runtime:
    interpreter: str
    files: tuple[str, ...]
    stdlib: str
    links: tuple[tuple[str, str], ...]
    hidden: tuple[str, ...]


@functools.cache
def _runtime() -> _Runtime:
    """The Python runtime to bind: this interpreter's real binary (not a venv's), its standard
    library and the shared libraries they need; ``site-packages`` under it hidden."""
    interpreter, _ = _chain(sys.executable)
    stdlib, links = _chain(sysconfig.get_paths(vars={"base": sys.base_prefix})["stdlib"])
    dynload = Path(stdlib) / "lib-dynload"
    modules = sorted(str(p) for p in dynload.glob("*.so")) if dynload.is_dir() else []
    files = set()
    for lib in _shared_libraries([interpreter, *modules]):
        real, lib_links = _chain(lib)
        links += lib_links
        if not real.startswith(stdlib + "/"):
            files.add(real)
    hidden = tuple(
        str(p) for p in (Path(stdlib) / "site-packages", Path(stdlib) / "dist-packages") if p.is_dir()
    )
    unique = tuple(dict.fromkeys(links))
    return _Runtime(interpreter, tuple(sorted(files - {interpreter})), stdlib, unique, hidden)


def _settings(settings: SandboxSettings | None) -> SandboxSettings:
    return settings if settings is not None else SandboxSettings()


def _tool(path: str, what: str, setting: str) -> str:
    if not os.path.isfile(path) or not os.access(path, os.X_OK):
        raise SandboxUnavailableError(
            f"no sandbox for untrusted code: {what} {path!r} is missing or not executable "
            f"(install it or set {setting}); code execution is refused"
        )
    return path


def _bwrap(settings: SandboxSettings) -> str:
    return _tool(settings.bwrap, "bubblewrap", "FORGE_SANDBOX_BWRAP")


def _setpriv(settings: SandboxSettings) -> list[str]:
    """``setpriv`` so bwrap is killed when this process dies and nothing it runs gains privileges."""
    return [
        _tool(settings.setpriv, "setpriv", "FORGE_SANDBOX_SETPRIV"),
        "--pdeathsig",
        "KILL",
        "--no-new-privs",
    ]


def _identity(settings: SandboxSettings) -> list[str]:
    """bwrap's namespace and identity options. As root, bwrap needs no user namespace (and one
    would map the sandbox to host root): it keeps only CAP_SETUID/CAP_SETGID, which the launcher
    uses to drop to ``uid``/``gid`` (losing every capability) before the program starts. As
    anyone else, a user namespace maps the sandbox to this (unprivileged) host uid."""
    common = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if os.geteuid() == 0:
        return [*common, "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    return [
        *common,
        "--unshare-user",
        "--disable-userns",
        "--uid",
        str(settings.uid),
        "--gid",
        str(settings.gid),
    ]


def _tasks_of(uid: int) -> int:
    """Threads the host already runs as ``uid``. Without a user namespace of its own, a sandbox's
    ``RLIMIT_NPROC`` counts every task of its host uid: this many come on top of the program's
    allowance, so other programs running as that uid (a concurrent sandbox, a job) neither eat
    it nor make the launch fail."""
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry}/task"))
    return count


def _command(
    settings: SandboxSettings, limits: SandboxLimits, program_fd: int, readonly_files: Sequence[str]
) -> list[str]:
    runtime = _runtime()
    args = [
        *_setpriv(settings),
        _bwrap(settings),
        *_identity(settings),
        "--die-with-parent",
        "--new-session",
        "--clearenv",
        "--hostname",
        "sandbox",
        "--dev",
        "/dev",
    ]
    size = str(limits.tmpfs_bytes)
    for scratch in ("/tmp", WORKDIR):
        args += ["--size", size, "--perms", "1777", "--tmpfs", scratch]
    binds = [
        runtime.interpreter,
        runtime.stdlib,
        *runtime.files,
        *(os.path.realpath(p) for p in readonly_files),
    ]
    # Parents bwrap would create with this process's umask (0700 under a strict one): 0755.
    parents = {str(d) for path in (*binds, *(link for link, _ in runtime.links)) for d in Path(path).parents}
    for parent in sorted(parents - {"/"}, key=lambda d: (d.count("/"), d)):
        args += ["--perms", "0755", "--dir", parent]
    for link, target in runtime.links:
        args += ["--symlink", target, link]
    for path in binds:
        args += ["--ro-bind", path, path]
    for hidden in runtime.hidden:
        args += ["--tmpfs", hidden]
    args += ["--file", str(program_fd), _PROGRAM, "--remount-ro", "/", "--chdir", WORKDIR]
    rlimits = {
        "AS": limits.memory_bytes,
        "CPU": int(limits.timeout_s) + 1,
        "FSIZE": limits.max_file_bytes,
        "CORE": 0,
        "NOFILE": limits.max_open_files,
        "NPROC": limits.max_processes + (_tasks_of(settings.uid) if os.geteuid() == 0 else 0),
    }
    spec = ",".join(f"{k}={v}" for k, v in rlimits.items())
    drop = f"{settings.uid}:{settings.gid}" if os.geteuid() == 0 else "-"
    return [*args, "--", runtime.interpreter, "-I", "-S", "-B", "-c", _LAUNCHER, spec, drop, _PROGRAM]


@functools.cache
def _probe(settings: SandboxSettings) -> str:
    """Empty when a trivial program runs in the sandbox here; else why not."""
    try:
        result = _run("raise SystemExit(0)\n", SandboxLimits(timeout_s=20.0), settings, ())
    except (OSError, subprocess.SubprocessError) as exc:
        return repr(exc)
    return "" if result.passed else f"{result.status}: {result.output.strip()[-500:]}"


def check_available(settings: SandboxSettings | None = None) -> None:
    """Raise :class:`SandboxUnavailableError` unless programs can run sandboxed here."""
    settings = _settings(settings)
    _bwrap(settings)
    _setpriv(settings)
    why = _probe(settings)
    if why:
        raise SandboxUnavailableError(
            f"no sandbox for untrusted code: bubblewrap {settings.bwrap} cannot start one here "
            f"(it needs unprivileged user namespaces): {why}; code execution is refused"
        )


def run_python(
    source: str,
    limits: SandboxLimits = SandboxLimits(),
    *,
    settings: SandboxSettings | None = None,
    readonly_files: Sequence[str] = (),
) -> SandboxResult:
    """Run ``source`` as a Python program in the sandbox and say whether it succeeded.

    ``readonly_files`` are host paths bound read-only at the same path (still subject to their
    permissions under the sandbox uid). Raises :class:`SandboxUnavailableError` where no sandbox
    can be had."""
    settings = _settings(settings)
    check_available(settings)
    return _run(source, limits, settings, readonly_files)


def _run(
    source: str, limits: SandboxLimits, settings: SandboxSettings, readonly_files: Sequence[str]
) -> SandboxResult:
    with tempfile.TemporaryFile() as program, tempfile.TemporaryFile() as output:
        program.write(source.encode())
        program.flush()
        program.seek(0)
        proc = subprocess.Popen(
            _command(settings, limits, program.fileno(), readonly_files),
            env={},
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            pass_fds=(program.fileno(),),
        )
        status = _wait(proc, limits.timeout_s)
        output.seek(0, os.SEEK_END)
        output.seek(max(0, output.tell() - 4 * _OUTPUT_TAIL))
        text = output.read().decode(errors="replace")[-_OUTPUT_TAIL:]
    if status is None:
        return SandboxResult(False, "timeout", text)
    if status == 0:
        return SandboxResult(True, "passed", text)
    if status < 0:
        return SandboxResult(False, f"killed by {signal.Signals(-status).name}", text)
    if status > 128 and status - 128 in signal.Signals._value2member_map_:
        # bwrap's reaper reports a signal-killed program as 128 + the signal.
        return SandboxResult(False, f"killed by {signal.Signals(status - 128).name}", text)
    return SandboxResult(False, "failed", text)


def _wait(proc: subprocess.Popen[bytes], timeout_s: float) -> int | None:
    """The exit status, or None after killing the sandbox at the timeout (its outer bwrap; the
    rest of the tree dies with the PID namespace)."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None
