"""Job isolation: every replica runs as an unprivileged user inside a bubblewrap sandbox.

The agent (root) starts ``bwrap``, which builds the sandbox as root — new PID, mount, IPC and
cgroup namespaces, a fresh ``/proc`` of the job's own PID namespace, a minimal ``/dev`` — and
then ``setpriv`` drops to the node's job uid/gid with no supplementary groups, no capabilities
(bounding set included) and ``no_new_privs`` before the job's command is executed. So the job is
an ordinary host user: root-owned files of mode 0600 stay unreadable even where they are visible,
and no process of the agent (or any other job) is in its PID namespace.

What the job sees of the host filesystem is an allow-list:

- read-only: ``/usr`` and ``/etc`` (with the ``/bin``, ``/lib``… entries as on the host), the
  agent's Python runtime and the directories on its ``sys.path`` (the code), the configured
  read paths (datasets, other jobs' run directories; glob patterns, expanded at each launch) and
  the object store;
- writable: its run directory (owned by the job uid), ``checkpoints/<job id>`` in a local object
  store, the configured write paths (handed to the job uid), a private ``/tmp``, and as
  ``/dev/shm`` a directory per job shared only by the job's replicas on this host (their
  shared-memory all-reduce);
- never: the agent's data directory and everything above it (a ``sys.path`` entry that holds it is
  left out), so the secrets and databases kept next to it are not there at all.

The network is the host's (torchrun's rendezvous, the object store and the scheduler are reached
over loopback). ``bwrap`` ignores SIGTERM (through ``env --ignore-signal``) so that stopping a job
— SIGTERM to its process group — reaches the job, which checkpoints while the sandbox waits; the
job's own command gets SIGTERM's default action back.

:meth:`JobSandbox.check` runs one real sandbox at start-up; when it cannot (not root, no
``bwrap``, no ``setpriv``), the agent reports jobs as unisolated (see
:class:`JobIsolation`) and refuses jobs of non-admin submitters unless told otherwise.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from forge.scheduler.v1 import scheduler_pb2

#: Host directories of the system a program needs (read-only); the others are symlinks or absent.
SYSTEM_DIRS = ("usr", "etc")
SYSTEM_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
#: Tools the sandbox chain uses, from util-linux and coreutils.
SETPRIV = "/usr/bin/setpriv"
ENV = "/usr/bin/env"
PROBE_TIMEOUT_S = 30.0
#: ``sh -c`` program for replicas after the first: fork ``$1`` short-lived subshells, then run the
#: rest of the arguments as a child (so its pid is past them) and exit with its status. SIGTERM
#: has a no-op handler here (the child keeps SIGTERM's default action and gets the signal itself,
#: from the process group); the shell stays until the child is gone.
_SKIP_PIDS = (
    'trap : TERM; i=0; while [ "$i" -lt "$1" ]; do (:); i=$((i + 1)); done; shift; "$@" & child=$!; '
    'while :; do wait "$child"; status=$?; kill -0 "$child" 2>/dev/null || exit "$status"; done'
)


@dataclass(frozen=True)
class JobIsolation:
    """Whether this node's jobs run isolated, and if not, why; announced to the scheduler."""

    isolated: bool
    detail: str
    uid: int = 0
    gid: int = 0
    allows_unisolated: bool = False
    """The operator lets this node run jobs of non-admin submitters although it cannot isolate them."""

    def refusal(self, submitted_by_admin: bool) -> str:
        """Why a job may not start here ('' when it may)."""
        if self.isolated or submitted_by_admin or self.allows_unisolated:
            return ""
        return (
            f"this node cannot isolate jobs ({self.detail}); it runs only jobs submitted by admins "
            "unless its operator sets allow_unisolated_jobs"
        )

    def to_proto(self) -> scheduler_pb2.JobIsolation:
        return scheduler_pb2.JobIsolation(
            isolated=self.isolated,
            detail=self.detail,
            job_uid=self.uid if self.isolated else 0,
            allows_unisolated=self.allows_unisolated,
        )


@dataclass(frozen=True)
class SandboxPlan:
    """What one replica's sandbox is made of (host paths; the job sees each at the same path)."""

    run_dir: Path
    job_id: str
    read_only: tuple[Path, ...]
    writable: tuple[Path, ...]
    shm_dir: Path | None
    devices: tuple[Path, ...]


def _is_under(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def code_paths(private: Iterable[Path]) -> tuple[Path, ...]:
    """The agent's Python runtime and code: its prefixes and ``sys.path`` directories, less the
    working directory and any directory that holds one of the ``private`` paths."""
    cwd = Path.cwd().resolve()
    private = [p.resolve() for p in private]
    found: list[Path] = []
    candidates = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *sys.path]
    for entry in candidates:
        if not entry:
            continue
        path = Path(entry).resolve()
        if not path.is_dir() or path == cwd or any(_is_under(p, path) for p in private):
            continue
        found.append(path)
    # The real interpreter behind a virtual environment's symlink.
    real = Path(sys.executable).resolve().parent.parent
    if real.is_dir() and not any(_is_under(p, real) for p in private):
        found.append(real)
    return _outermost(found)


def _outermost(paths: Iterable[Path]) -> tuple[Path, ...]:
    """``paths`` without duplicates and without those inside another one, sorted."""
    unique = sorted(set(paths), key=lambda p: (len(p.parts), str(p)))
    kept: list[Path] = []
    for path in unique:
        if not any(_is_under(path, k) for k in kept):
            kept.append(path)
    return tuple(sorted(kept))


class JobSandbox:
    """Builds the ``bwrap`` command line of a replica and prepares its directories."""

    def __init__(
        self,
        *,
        bwrap: str,
        uid: int,
        gid: int,
        read_paths: Sequence[str] = (),
        write_paths: Sequence[str] = (),
        objects_root: str = "",
        private: Sequence[Path] = (),
        shm_root: Path = Path("/dev/shm"),
    ) -> None:
        if uid <= 0 or gid <= 0:
            raise ValueError("the job uid and gid must not be root's")
        self.bwrap, self.uid, self.gid = bwrap, uid, gid
        self._shm_root = shm_root
        objects = Path(objects_root).resolve() if objects_root and "://" not in objects_root else None
        self._objects = objects
        private_paths = [Path(p).resolve() for p in private]
        self._code = [*code_paths(private_paths), *([objects] if objects else [])]
        self._read_patterns = [p for p in read_paths if p]
        self._write_paths = tuple(Path(p).resolve() for p in write_paths if p)

    # --- start-up ----------------------------------------------------------------------------

    def check(self) -> JobIsolation:
        """Whether jobs can run isolated here: the tools exist and a probe sandbox runs."""
        problem = self._missing()
        if problem:
            return JobIsolation(False, problem, self.uid, self.gid)
        with tempfile.TemporaryDirectory(prefix="forge-sandbox-probe-") as tmp:
            run_dir = Path(tmp) / "probe"
            self.prepare(run_dir, "probe")
            argv = self.argv(self.plan(run_dir, "probe"), ["/usr/bin/test", "-w", str(run_dir)])
            try:
                done = subprocess.run(
                    argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False, env={}
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                return JobIsolation(False, f"the probe sandbox did not run: {exc}", self.uid, self.gid)
            finally:
                self.release(run_dir, "probe")
        if done.returncode != 0:
            reason = done.stderr.strip()[-300:] or f"exit code {done.returncode}"
            return JobIsolation(False, f"the probe sandbox failed: {reason}", self.uid, self.gid)
        return JobIsolation(
            True, f"bubblewrap; jobs run as uid {self.uid} gid {self.gid}", self.uid, self.gid
        )

    def _missing(self) -> str:
        if os.geteuid() != 0:
            return f"the agent runs as uid {os.geteuid()}, not root, so it cannot run jobs as another user"
        if not self.bwrap:
            return "job isolation is turned off (job_sandbox is empty)"
        for tool, package in ((self.bwrap, "bubblewrap"), (SETPRIV, "util-linux"), (ENV, "coreutils")):
            if not (os.path.isfile(tool) and os.access(tool, os.X_OK)):
                return f"{tool} not found (Debian package {package})"
        return ""

    # --- per replica -------------------------------------------------------------------------

    def plan(self, run_dir: Path, job_id: str) -> SandboxPlan:
        run_dir = run_dir.resolve()
        matched = [Path(m).resolve() for pattern in self._read_patterns for m in glob.glob(pattern)]
        read_only = _outermost([*self._code, *(p for p in matched if p.is_dir())])
        writable = [*self._write_paths, run_dir]
        if self._objects is not None:
            writable.append(self._objects / "checkpoints" / job_id)
        shm = self._shm_root / f"forge-job-{job_id}" if self._shm_root.is_dir() else None
        devices = tuple(Path(p) for p in sorted(glob.glob("/dev/nvidia*")) if not os.path.isdir(p))
        return SandboxPlan(run_dir, job_id, read_only, tuple(writable), shm, devices)

    def prepare(self, run_dir: Path, job_id: str) -> None:
        """Create the replica's writable directories, owned by the job user."""
        plan = self.plan(run_dir, job_id)
        for path in [*plan.writable, *([plan.shm_dir] if plan.shm_dir else [])]:
            path.mkdir(parents=True, exist_ok=True)
            info = os.lstat(path)
            if not stat.S_ISDIR(info.st_mode):
                raise OSError(f"{path} is not a directory")
            os.chown(path, self.uid, self.gid, follow_symlinks=False)
        if plan.shm_dir is not None:
            plan.shm_dir.chmod(0o700)

    def release(self, run_dir: Path, job_id: str) -> None:
        """Remove what :meth:`prepare` made that holds nothing of value (the empty shm folder)."""
        shm = self.plan(run_dir, job_id).shm_dir
        if shm is not None:
            with contextlib.suppress(OSError):  # not empty, or already gone
                shm.rmdir()

    def argv(self, plan: SandboxPlan, command: Sequence[str], pid_offset: int = 0) -> list[str]:
        """``env --ignore-signal=TERM bwrap … setpriv … env --default-signal=TERM <command>``.

        ``pid_offset`` processes are forked (and gone) before ``command`` starts, so that the
        replicas of one job on one host — each its sandbox's first process otherwise — have
        distinct pids: torchrun names a node in the c10d rendezvous by host name and pid."""
        args = [ENV, "--ignore-signal=TERM", self.bwrap]
        args += ["--unshare-pid", "--unshare-ipc", "--unshare-cgroup-try", "--die-with-parent"]
        for name in SYSTEM_DIRS:
            if os.path.isdir(f"/{name}"):
                args += ["--ro-bind", f"/{name}", f"/{name}"]
        for name in SYSTEM_LINKS:
            host = f"/{name}"
            if os.path.islink(host):
                args += ["--symlink", os.readlink(host), host]
            elif os.path.isdir(host):
                args += ["--ro-bind", host, host]
        args += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--tmpfs", "/tmp"]
        for device in plan.devices:
            args += ["--dev-bind", str(device), str(device)]
        if plan.devices and os.path.isdir("/sys"):
            args += ["--ro-bind", "/sys", "/sys"]
        if plan.shm_dir is not None:
            args += ["--bind", str(plan.shm_dir), "/dev/shm"]
        else:
            args += ["--perms", "1777", "--tmpfs", "/dev/shm"]
        made: set[Path] = {Path("/"), Path("/tmp")}
        mounted: list[Path] = [Path(f"/{n}") for n in SYSTEM_DIRS]  # host folders: parents exist
        for flag, paths in (("--ro-bind", plan.read_only), ("--bind", plan.writable)):
            for path in paths:
                if not path.exists():
                    continue
                for parent in reversed(path.parents):
                    if parent in made or any(_is_under(parent, m) for m in mounted):
                        continue
                    args += ["--perms", "0755", "--dir", str(parent)]
                    made.add(parent)
                args += [flag, str(path), str(path)]
                mounted.append(path)
        args += ["--chdir", str(plan.run_dir)]
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]
        args += [
            SETPRIV,
            f"--reuid={self.uid}",
            f"--regid={self.gid}",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--no-new-privs",
            "--",
            ENV,
            "--default-signal=TERM",
        ]
        if pid_offset > 0:
            args += ["/bin/sh", "-c", _SKIP_PIDS, "sh", str(pid_offset)]
        return [*args, *command]

    def which(self, program: str, path_env: str) -> str | None:
        """Where ``program`` would be found (its own path when it names one)."""
        if os.sep in program:
            return program if os.access(program, os.X_OK) else None
        return shutil.which(program, path=path_env)
