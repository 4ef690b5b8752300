"""How a job replica becomes a process on this node.

:class:`JobRunner` is the seam: the agent hands it a :class:`LaunchSpec` and gets back a
:class:`JobProcess` to wait on or stop. :class:`LocalProcessRunner` runs the job's command — inside
a :class:`~forge_trainer_agent.sandbox.JobSandbox` when given one (as the agent's user otherwise);
a torchrun runner (launching ``torchrun --nnodes … --node-rank …`` around the command, with
checkpoint hand-off) plugs in behind the same protocol: :class:`TorchrunRunner`.

A job's environment is built from an allow-list (:func:`job_environment`), never copied from the
agent's, whose variables hold its credentials.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from forge_kit.jobenv import TERMINATION_LOG_ENV
from forge_trainer_agent.sandbox import JobSandbox

#: The only variables of the agent's environment a job gets: where programs and the Python code
#: are, the locale, and the node's collective-communication settings (``NCCL_*``, the gloo and
#: torchrun network interface: which NIC and fabric this node's jobs talk over, set by the
#: operator on the agent; docs/DEPLOY.md). Everything else a job sees is its own declared env and
#: its placement.
INHERITED_ENV = (
    "PATH",
    "PYTHONPATH",
    "VIRTUAL_ENV",
    "LD_LIBRARY_PATH",
    "FORGE_DATA_DIR",
    "LANG",
    "LANGUAGE",
    "TZ",
    "GLOO_SOCKET_IFNAME",
    "TP_SOCKET_IFNAME",
)
INHERITED_ENV_PREFIXES = ("LC_", "NCCL_")


@dataclass(frozen=True)
class LaunchSpec:
    """Everything needed to start one attempt of one job replica."""

    job_id: str
    attempt: int
    command: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    gpu_indices: tuple[int, ...] = ()
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str = ""
    master_port: int = 0
    run_dir: Path = Path(".")
    log_path: Path = Path("job.log")
    serving: bool = False
    """A serving replica (``JOB_KIND_INFERENCE``): an engine's server, not a torch worker, so it
    never runs under torchrun, and clients reach it on the host's network at the port the agent
    assigned."""


@dataclass(frozen=True)
class ExitStatus:
    """How a process ended; ``code`` follows the shell: ``128 + N`` when killed by signal ``N``."""

    code: int
    signal: int | None = None

    @classmethod
    def from_returncode(cls, returncode: int) -> ExitStatus:
        if returncode < 0:
            return cls(code=128 - returncode, signal=-returncode)
        return cls(code=returncode)

    @classmethod
    def from_wrapper_code(cls, returncode: int) -> ExitStatus:
        """The status of a command run by a wrapper that reports death by signal ``N`` as exit
        code ``128 + N`` (bubblewrap)."""
        if 128 < returncode < 128 + signal.NSIG:
            return cls(code=returncode, signal=returncode - 128)
        return cls.from_returncode(returncode)

    def describe(self) -> str:
        if self.signal is not None:
            return f"killed by {signal.Signals(self.signal).name}"
        return f"exited with code {self.code}"


class LaunchError(Exception):
    """The command could not be started; ``exit_code`` follows the shell (127 not found, 126 not executable)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class JobProcess(Protocol):
    """A started replica. The agent's supervisor task awaits :meth:`wait`; preemption,
    cancellation and the runtime limit call :meth:`stop`. Both may be awaited concurrently."""

    @property
    def pid(self) -> int: ...

    async def wait(self) -> ExitStatus:
        """Block until the replica has exited and nothing of it is left running."""
        ...

    async def stop(self, grace_s: float) -> ExitStatus:
        """Ask the replica to exit (SIGTERM: checkpoint and leave), kill it after ``grace_s``."""
        ...


class JobRunner(Protocol):
    """Starts replicas. Called by :class:`~forge_trainer_agent.service.AgentService` once per
    StartJob, after the attempt is recorded; returns as soon as the process exists and raises
    :class:`LaunchError` when it cannot start."""

    async def launch(self, spec: LaunchSpec) -> JobProcess: ...


def termination_log(log_path: Path) -> Path:
    """The termination-message file of the attempt that logs to ``log_path``."""
    return log_path.with_name(f"{log_path.stem}.termination")


def job_environment(spec: LaunchSpec, base: Mapping[str, str]) -> dict[str, str]:
    """The replica's environment: the allow-listed basics of ``base`` (:data:`INHERITED_ENV`),
    ``HOME`` as its run directory, the job's own variables, then the placement variables, which
    the job cannot override."""
    env = {k: v for k, v in base.items() if k in INHERITED_ENV or k.startswith(INHERITED_ENV_PREFIXES)}
    env.setdefault("PATH", os.defpath)
    env["HOME"] = str(spec.run_dir)
    env.update(spec.env)
    env.update(
        FORGE_JOB_ID=spec.job_id,
        FORGE_ATTEMPT=str(spec.attempt),
        FORGE_RUN_DIR=str(spec.run_dir),
        **{TERMINATION_LOG_ENV: str(termination_log(spec.log_path))},
        CUDA_VISIBLE_DEVICES=",".join(str(i) for i in spec.gpu_indices),
        # The agent numbers GPUs as NVML does (PCI bus order); CUDA's default order is fastest first.
        CUDA_DEVICE_ORDER="PCI_BUS_ID",
        NODE_RANK=str(spec.node_rank),
        NNODES=str(spec.num_nodes),
        RANK=str(spec.node_rank),
        WORLD_SIZE=str(spec.num_nodes),
        LOCAL_RANK="0",
    )
    if spec.master_addr:
        env["MASTER_ADDR"] = spec.master_addr
    if spec.master_port:
        env["MASTER_PORT"] = str(spec.master_port)
    return env


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


class LocalProcess:
    """A replica running as a local process group (the group id is the leader's pid)."""

    def __init__(
        self,
        proc: asyncio.subprocess.Process,
        on_exit: Callable[[], None] = lambda: None,
        wrapped: bool = False,
    ) -> None:
        self._proc = proc
        self._on_exit = on_exit
        self._wrapped = wrapped

    @property
    def pid(self) -> int:
        return self._proc.pid

    async def wait(self) -> ExitStatus:
        returncode = await self._proc.wait()
        # Whatever the leader left behind (dataloader workers, shells) must not hold the GPUs.
        _signal_group(self._proc.pid, signal.SIGKILL)
        if self._wrapped:
            return ExitStatus.from_wrapper_code(returncode)
        return ExitStatus.from_returncode(returncode)

    async def stop(self, grace_s: float) -> ExitStatus:
        if self._proc.returncode is None:
            _signal_group(self._proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.shield(self._proc.wait()), timeout=grace_s)
            except TimeoutError:
                _signal_group(self._proc.pid, signal.SIGKILL)
        return await self.wait()


class LocalProcessRunner:
    """Runs the job's command in its own process group and working directory ``run_dir``, with
    stdout and stderr appended to ``log_path``: inside ``sandbox`` when given (as its job user),
    else directly as the agent's user."""

    def __init__(self, base_env: Mapping[str, str] | None = None, sandbox: JobSandbox | None = None) -> None:
        self._base_env = dict(os.environ if base_env is None else base_env)
        self._sandbox = sandbox

    async def launch(self, spec: LaunchSpec) -> LocalProcess:
        if not spec.command:
            raise LaunchError("the job has no command", exit_code=127)
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = job_environment(spec, self._base_env)
        if self._sandbox is not None:
            return await self._launch_sandboxed(spec, env, self._sandbox)
        with open(spec.log_path, "ab") as log:
            try:
                proc = await asyncio.create_subprocess_exec(
                    *spec.command,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log,
                    stderr=asyncio.subprocess.STDOUT,
                    cwd=spec.run_dir,
                    env=env,
                    start_new_session=True,
                )
            except FileNotFoundError:
                raise LaunchError(f"command not found: {spec.command[0]!r}", exit_code=127) from None
            except PermissionError:
                raise LaunchError(f"command not executable: {spec.command[0]!r}", exit_code=126) from None
        return LocalProcess(proc)

    @staticmethod
    async def _launch_sandboxed(spec: LaunchSpec, env: dict[str, str], sandbox: JobSandbox) -> LocalProcess:
        if sandbox.which(spec.command[0], env["PATH"]) is None:
            raise LaunchError(f"command not found: {spec.command[0]!r}", exit_code=127)
        try:
            sandbox.prepare(spec.run_dir, spec.job_id)
            plan = sandbox.plan(spec.run_dir, spec.job_id, spec.num_nodes, serving=spec.serving)
            with (
                open(spec.log_path, "ab") as log,
                sandbox.started_by(plan, spec.command, env, spec.node_rank) as (
                    argv,
                    fds,
                ),
            ):
                proc = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log,
                    stderr=asyncio.subprocess.STDOUT,
                    cwd=spec.run_dir,
                    env=sandbox.launcher_env(spec.job_id),
                    start_new_session=True,
                    pass_fds=fds,
                )
        except (OSError, ValueError) as exc:
            raise LaunchError(f"cannot start the job's sandbox: {exc}", exit_code=126) from None
        return LocalProcess(proc, wrapped=True)


class TorchrunRunner:
    """Runs the job's command under ``torchrun``: one worker per assigned GPU (one when none),
    ``--standalone`` for a one-node job, otherwise a c10d rendezvous at the job's master address
    (so several agents, even on one machine over loopback, form one process group).

    torchrun gives each worker its ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``; stopping sends
    SIGTERM to the whole process group, so the workers checkpoint (see
    :mod:`forge_training.run`) while torchrun waits for them.
    """

    def __init__(
        self,
        base_env: Mapping[str, str] | None = None,
        torchrun: Sequence[str] = (sys.executable, "-m", "torch.distributed.run"),
        sandbox: JobSandbox | None = None,
    ) -> None:
        self._local = LocalProcessRunner(base_env, sandbox)
        self._torchrun = tuple(torchrun)

    def command(self, spec: LaunchSpec) -> tuple[str, ...]:
        """The full command line for ``spec`` (the job's command follows ``--no-python``)."""
        args = [
            *self._torchrun,
            f"--nnodes={spec.num_nodes}",
            f"--nproc-per-node={max(1, len(spec.gpu_indices))}",
        ]
        if spec.num_nodes == 1 and not spec.master_addr:
            args.append("--standalone")
        else:
            if not spec.master_addr or not spec.master_port:
                raise LaunchError("a multi-node job needs master_addr and master_port", exit_code=127)
            args += [
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={spec.master_addr}:{spec.master_port}",
                f"--rdzv-id={spec.job_id}-{spec.attempt}",
                f"--node-rank={spec.node_rank}",
            ]
        return (*args, "--no-python", *spec.command)

    async def launch(self, spec: LaunchSpec) -> LocalProcess:
        if not spec.command:
            raise LaunchError("the job has no command", exit_code=127)
        if spec.serving:
            return await self._local.launch(spec)
        wrapped = LaunchSpec(
            job_id=spec.job_id,
            attempt=spec.attempt,
            command=self.command(spec),
            env=spec.env,
            gpu_indices=spec.gpu_indices,
            node_rank=spec.node_rank,
            num_nodes=spec.num_nodes,
            master_addr=spec.master_addr,
            master_port=spec.master_port,
            run_dir=spec.run_dir,
            log_path=spec.log_path,
        )
        return await self._local.launch(wrapped)
