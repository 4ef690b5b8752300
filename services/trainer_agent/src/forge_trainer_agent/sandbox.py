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
  read paths (the data folder's datasets, other jobs' run directories; glob patterns, expanded
  at each launch) and the object store;
- writable: its run directory (owned by the job uid), ``checkpoints/<job id>`` in a local object
  store, the configured write paths (handed to the job uid), a private ``/tmp``, and as
  ``/dev/shm`` a directory per job shared only by the job's replicas on this host (their
  shared-memory all-reduce; it is left in place, empty, when a replica ends, as a replica of the
  job on another agent may still use it);
- never: the agent's data directory and everything above it (a ``sys.path`` entry that holds it is
  left out), so the secrets and databases kept next to it are not there at all.

The processes that run as root (bubblewrap, ``setpriv``) get an empty environment; the job's
variables are set by a script bound into the sandbox and run after the privileges are dropped.
A job placed on one node gets its own network namespace (``--unshare-net``): its replicas and
torchrun's rendezvous meet on its own loopback, and nothing listening on the host (Temporal, the
broker, PostgreSQL, Redis, the services) can be reached. A job spread over several nodes, or
one on a node whose object store is reached over the network, keeps the host's network (its
replicas meet there), as does a serving replica (the gateway reaches it at its assigned port;
it also reads ``/sys``, as GPU jobs do, for vLLM's ``lscpu``). ``bwrap`` ignores SIGTERM (through ``env --ignore-signal``) so that stopping a job
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
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from forge.scheduler.v1 import scheduler_pb2

from forge_kit import datasets
from forge_kit.paths import data_dir

#: Host directories of the system a program needs (read-only); the others are symlinks or absent.
SYSTEM_DIRS = ("usr", "etc")
SYSTEM_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
#: Variables naming the network interface of collectives: ``lo`` inside a private network.
NETWORK_INTERFACE_ENV = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME")
#: Tools the sandbox chain uses, from util-linux and coreutils.
SETPRIV = "/usr/bin/setpriv"
ENV = "/usr/bin/env"
PROBE_TIMEOUT_S = 30.0
#: Where the sandbox finds the script that sets the job's environment and starts its command.
LAUNCH_SCRIPT = "/run/forge/launch"


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
    private_network: bool = True
    """Its own network namespace (only its own loopback): every replica of a job on one node.
    False for a job spread over several nodes (its replicas meet over the host's network), for a
    serving replica (the gateway reaches it at the port the agent assigned) and where the object
    store is reached over the network."""
    serving: bool = False
    """A serving replica: besides the host's network it reads ``/sys`` (vLLM's CPU worker learns
    the cores it may use from ``lscpu``, which reads ``/sys/devices/system``), as GPU jobs do."""


@dataclass(frozen=True)
class SandboxLaunch:
    """How to start one sandbox: ``argv``, whose ``--args`` and ``--ro-bind-data`` file
    descriptors must hold ``args`` (bubblewrap's options) and ``script`` (the job's environment):
    so neither shows in ``ps``, and the job's variables never reach a process running as root."""

    argv: tuple[str, ...]
    args: bytes
    script: bytes


def dataset_folders() -> list[Path]:
    """The data folder's dataset folders (``corpora``, ``beir``…, from the catalog in
    :mod:`forge_kit.datasets`), which jobs read; not the data folder itself, which may be set to a
    folder that also holds other things."""
    root = data_dir()
    tops = {PurePosixPath(d.folder).parts[0] for d in datasets.catalog().values()}
    return [root / top for top in sorted(tops)]


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
        self._remote_objects = bool(objects_root) and objects is None
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
        # A probe id of its own: agents on one host probe at once, and a shared id shares the
        # probe's /dev/shm folder, which the first to finish removes under the others.
        probe_id = f"probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        with tempfile.TemporaryDirectory(prefix="forge-sandbox-probe-") as tmp:
            run_dir = Path(tmp) / "probe"
            self.prepare(run_dir, probe_id)
            probe = ["/usr/bin/test", "-w", str(run_dir)]
            try:
                with self.started_by(self.plan(run_dir, probe_id), probe, {}) as (argv, fds):
                    done = subprocess.run(
                        argv,
                        capture_output=True,
                        text=True,
                        timeout=PROBE_TIMEOUT_S,
                        check=False,
                        env=self.launcher_env(probe_id),
                        pass_fds=fds,
                    )
            except (OSError, subprocess.TimeoutExpired) as exc:
                return JobIsolation(False, f"the probe sandbox did not run: {exc}", self.uid, self.gid)
            finally:
                self.release(run_dir, probe_id)
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

    def plan(self, run_dir: Path, job_id: str, num_nodes: int = 1, *, serving: bool = False) -> SandboxPlan:
        """The sandbox of a replica of ``job_id`` (placed on ``num_nodes`` nodes in all; ``serving``:
        a serving replica, which clients reach on the host's network)."""
        run_dir = run_dir.resolve()
        matched = [Path(m).resolve() for pattern in self._read_patterns for m in glob.glob(pattern)]
        read_only = _outermost([*self._code, *(p for p in matched if p.is_dir())])
        writable = [*self._write_paths, run_dir]
        if self._objects is not None:
            writable.append(self._objects / "checkpoints" / job_id)
        shm = self._shm_root / f"forge-job-{job_id}" if self._shm_root.is_dir() else None
        devices = tuple(Path(p) for p in sorted(glob.glob("/dev/nvidia*")) if not os.path.isdir(p))
        private_network = num_nodes <= 1 and not self._remote_objects and not serving
        return SandboxPlan(
            run_dir, job_id, read_only, tuple(writable), shm, devices, private_network, serving
        )

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
        """Remove the job's shm folder if it is empty. Only for a job no other replica on this
        host may still run (the probe): removing a folder another sandbox has bound as its
        ``/dev/shm`` detaches it there."""
        shm = self.plan(run_dir, job_id).shm_dir
        if shm is not None:
            with contextlib.suppress(OSError):  # not empty, or already gone
                shm.rmdir()

    @contextlib.contextmanager
    def started_by(
        self, plan: SandboxPlan, command: Sequence[str], env: Mapping[str, str], pid_offset: int = 0
    ) -> Iterator[tuple[list[str], tuple[int, int]]]:
        """The command line that starts the sandbox of :meth:`launch` and the file descriptors
        it reads (pass them to the child), open while the context lasts."""
        with tempfile.TemporaryFile() as args_file, tempfile.TemporaryFile() as script_file:
            fds = (args_file.fileno(), script_file.fileno())
            launch = self.launch(plan, command, env, *fds, pid_offset=pid_offset)
            for handle, data in ((args_file, launch.args), (script_file, launch.script)):
                handle.write(data)
                handle.flush()
                handle.seek(0)
            yield list(launch.argv), fds

    @staticmethod
    def launcher_env(job_id: str) -> dict[str, str]:
        """The environment of the processes that run as root (bubblewrap, then ``setpriv``): none
        of the job's variables (a job's ``LD_PRELOAD`` must never reach them), only ``PATH`` and
        ``FORGE_JOB_ID``, by which the agent recognises the job's processes after a restart."""
        return {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "FORGE_JOB_ID": job_id}

    def launch(
        self,
        plan: SandboxPlan,
        command: Sequence[str],
        env: Mapping[str, str],
        args_fd: int,
        script_fd: int,
        pid_offset: int = 0,
    ) -> SandboxLaunch:
        """The sandbox for ``command``: bubblewrap's options (read from a file descriptor), then
        ``setpriv`` to the job user, then a shell script (bound read-only from ``script_fd``) that
        runs ``env -i <the job's environment> --default-signal=TERM <command>``; the processes
        that run as root start with an empty environment.

        With ``pid_offset`` the script first forks that many short-lived subshells and runs the
        command as its child, so that the replicas of one job on one host — each its sandbox's
        first process otherwise — have distinct pids: torchrun names a node in the c10d
        rendezvous by host name and pid."""
        for key, value in env.items():
            if not key or "=" in key or "\0" in key or "\0" in value:
                raise ValueError(f"environment variable {key!r} is not usable")
        if any("\0" in arg for arg in command):
            raise ValueError("a command argument holds a NUL character")
        args = ["--unshare-pid", "--unshare-ipc", "--unshare-cgroup-try", "--die-with-parent"]
        if plan.private_network:
            # Only its own loopback: no Temporal, broker, database or service port of the host.
            args += ["--unshare-net"]
            env = {**env, **{k: "lo" for k in NETWORK_INTERFACE_ENV if k in env}}
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
        if (plan.devices or plan.serving) and os.path.isdir("/sys"):
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
        args += ["--perms", "0755", "--dir", str(Path(LAUNCH_SCRIPT).parent)]
        args += ["--perms", "0555", "--ro-bind-data", str(script_fd), LAUNCH_SCRIPT]
        args += ["--chdir", str(plan.run_dir), "--clearenv"]
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]
        argv = [
            ENV,
            "--ignore-signal=TERM",
            self.bwrap,
            "--args",
            str(args_fd),
            SETPRIV,
            f"--reuid={self.uid}",
            f"--regid={self.gid}",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--no-new-privs",
            "--",
            "/bin/sh",
            LAUNCH_SCRIPT,
            *command,
        ]
        start = " ".join(
            [
                ENV,
                "-i",
                "--default-signal=TERM",
                "--",
                *(shlex.quote(f"{k}={v}") for k, v in sorted(env.items())),
            ]
        )
        if pid_offset > 0:
            script = (
                f'trap : TERM; i=0; while [ "$i" -lt {int(pid_offset)} ]; do (:); i=$((i + 1)); done\n'
                f'{start} "$@" & child=$!\n'
                'while :; do wait "$child"; status=$?; kill -0 "$child" 2>/dev/null || exit "$status"; done\n'
            )
        else:
            script = f'exec {start} "$@"\n'
        return SandboxLaunch(tuple(argv), "\0".join(args).encode() + b"\0", script.encode())

    def which(self, program: str, path_env: str) -> str | None:
        """Where ``program`` would be found (its own path when it names one)."""
        if os.sep in program:
            return program if os.access(program, os.X_OK) else None
        return shutil.which(program, path=path_env)
