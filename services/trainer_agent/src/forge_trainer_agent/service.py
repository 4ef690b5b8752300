"""Trainer agent domain logic: apply the scheduler's commands to local processes, record every
attempt in the agent's database, and queue the status reports the session sends back.

A command never blocks the session: :meth:`AgentService.submit` runs it as a task, and commands
for the same job apply in order. Each attempt has a supervisor task that waits for its process and
records how it ended. A state is first written to the database, then queued for the scheduler; if
the session is down, it is sent after the next registration (:meth:`AgentService.request_resync`).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import re
import signal
import uuid
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from forge.common.v1 import common_pb2
from forge.scheduler.v1 import scheduler_pb2
from prometheus_client import Counter, Gauge

from forge_kit import errors
from forge_kit.jobenv import SERVE_PORT_ENV, with_serve_port
from forge_kit.ports import free_port
from forge_trainer_agent.checkpoints import CheckpointAnnouncer
from forge_trainer_agent.metrics import MetricsStreamer, attempt_offset
from forge_trainer_agent.node import NodeInfo
from forge_trainer_agent.runner import (
    ExitStatus,
    JobProcess,
    JobRunner,
    LaunchError,
    LaunchSpec,
    termination_log,
)
from forge_trainer_agent.store import RunRow, RunStore, utcnow

log = structlog.get_logger(__name__)

JobState = common_pb2.JobState
SCHEDULED, RUNNING = JobState.JOB_STATE_SCHEDULED, JobState.JOB_STATE_RUNNING
SUCCEEDED, FAILED = JobState.JOB_STATE_SUCCEEDED, JobState.JOB_STATE_FAILED
PREEMPTED, CANCELLED = JobState.JOB_STATE_PREEMPTED, JobState.JOB_STATE_CANCELLED

#: Exit code reported when no process exit code exists (never started, or lost).
NO_EXIT_CODE = -1
LOG_TAIL_BYTES = 2000
MESSAGE_LIMIT = 1000
_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

RUNS_ACTIVE = Gauge("forge_trainer_agent_runs_active", "Job replicas running on this node")
RUNS_FINISHED = Counter("forge_trainer_agent_runs_finished_total", "Attempts that ended, by state", ["state"])


@dataclass(frozen=True)
class StatusReport:
    """A JobStatusUpdate for the scheduler; ``version`` is the run row's version (None when the
    report belongs to no stored run, e.g. a command with an unusable job id)."""

    job_id: str
    attempt: int
    version: int | None
    update: scheduler_pb2.JobStatusUpdate


@dataclass(frozen=True)
class NodeStatus:
    """What GetNodeStatus answers."""

    node: NodeInfo
    node_id: str
    connected: bool
    running: list[RunRow]


@dataclass
class _Active:
    """A live attempt: its process, its supervisor, and how it is being stopped, if it is."""

    job_id: str
    attempt: int
    process: JobProcess
    max_runtime_s: float | None
    gpu_indices: frozenset[int]
    stop_state: int | None = None
    stop_reason: str = ""
    supervisor: asyncio.Task[None] | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    metrics: asyncio.Task[None] | None = None
    """Publishes the run's training metrics while it lives (rank 0 writes them)."""


def _report(row: RunRow, endpoint: str = "") -> StatusReport:
    update = scheduler_pb2.JobStatusUpdate(
        job_id=row.job_id,
        state=row.state,  # type: ignore[arg-type]
        message=row.message,
        step=row.step,
        exit_code=NO_EXIT_CODE
        if row.exit_code is None and row.state not in (SCHEDULED, RUNNING)
        else row.exit_code or 0,
        endpoint=endpoint if row.state == RUNNING else "",
    )
    return StatusReport(job_id=row.job_id, attempt=row.attempt, version=row.version, update=update)


def _failure_reason(log_path: str) -> str:
    """Why an attempt failed, for its message: what the job wrote to its termination log,
    else the last lines of its output."""
    try:
        written = termination_log(Path(log_path)).read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        written = ""
    return written[:MESSAGE_LIMIT] or _log_tail(log_path)


def _log_tail(path: str) -> str:
    """The last lines of a job's log, for the message of a failed attempt."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - LOG_TAIL_BYTES))
            text = handle.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-5:])


def _process_of_job(pid: int, job_id: str) -> bool:
    """True when ``pid`` is alive and was started for ``job_id`` (its environment says so), so an
    unrelated process that reused the pid is never signalled."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"FORGE_JOB_ID={job_id}".encode() in environ.split(b"\0")


class AgentService:
    """The node's jobs: start, supervise, stop, record, report."""

    def __init__(
        self,
        store: RunStore,
        runner: JobRunner,
        node: NodeInfo,
        *,
        runs_dir: Path,
        stop_grace_s: float = 30.0,
        clock: Callable[[], dt.datetime] = utcnow,
        outbound_limit: int = 1000,
        announcer: CheckpointAnnouncer | None = None,
        objects_url: str = "",
        metrics: MetricsStreamer | None = None,
        advertise_address: str = "127.0.0.1",
        ports: Callable[[], int] = free_port,
    ) -> None:
        self.node = node
        self._advertise = advertise_address
        self._ports = ports
        self._endpoints: dict[str, str] = {}
        """Serving jobs' URLs, by job id, while their attempt lives (the RUNNING report's)."""
        self._announcer = announcer
        self._metrics = metrics
        self._objects_url = objects_url
        self.node_id = ""
        self.connected = False
        self._store = store
        self._runner = runner
        self._runs_dir = runs_dir
        self._stop_grace_s = stop_grace_s
        self._clock = clock
        self._active: dict[str, _Active] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._outbound: deque[StatusReport] = deque()
        self._outbound_limit = outbound_limit
        self._resync = True
        self._reported: dict[tuple[str, int], int] = {}
        self.outbound_ready = asyncio.Event()

    # --- session bookkeeping -----------------------------------------------------------------

    def session_opened(self, node_id: str) -> None:
        self.node_id, self.connected = node_id, True

    def session_closed(self) -> None:
        self.connected = False

    def running_job_ids(self) -> list[str]:
        """Jobs with a live process on this node (what RegisterNode and Heartbeat carry)."""
        return sorted(self._active)

    def request_resync(self) -> None:
        """Make the next :meth:`reports` answer from the database: every run whose newest state
        the scheduler has not been sent. Called when a session registers."""
        self._resync = True
        self.outbound_ready.set()

    async def reports(self) -> list[StatusReport]:
        """Reports to send now, oldest first, leaving out any the scheduler already has a newer
        state of. Called by the session's writer whenever ``outbound_ready`` is set."""
        if self._resync:
            self._resync = False
            self._outbound.clear()
            return [self._report(row) for row in await self._store.unreported()]
        taken = list(self._outbound)
        self._outbound.clear()
        return [
            r for r in taken if r.version is None or r.version > self._reported.get((r.job_id, r.attempt), 0)
        ]

    async def mark_reported(self, report: StatusReport) -> None:
        """Called by the session once ``report`` is written to the stream."""
        if report.version is None:
            return
        key = (report.job_id, report.attempt)
        self._reported[key] = max(self._reported.get(key, 0), report.version)
        await self._store.mark_reported(report.job_id, report.attempt, report.version)

    def _report(self, row: RunRow) -> StatusReport:
        return _report(row, self._endpoints.get(row.job_id, ""))

    def _emit(self, report: StatusReport) -> None:
        if len(self._outbound) >= self._outbound_limit:
            # The database still holds every state: resend from there instead of growing.
            self._resync = True
        else:
            self._outbound.append(report)
        self.outbound_ready.set()

    # --- commands ----------------------------------------------------------------------------

    def submit(self, command: scheduler_pb2.AgentSessionResponse) -> None:
        """Apply a command from the scheduler in the background (the session keeps reading)."""
        self._spawn(self.handle(command), name=f"command-{command.WhichOneof('message')}")

    async def handle(self, command: scheduler_pb2.AgentSessionResponse) -> None:
        """Apply one command and return when it has taken effect: the process is started, or
        it has exited after being stopped."""
        kind = command.WhichOneof("message")
        if kind == "start_job":
            await self.start_job(command.start_job)
        elif kind == "preempt_job":
            grace = float(command.preempt_job.grace_seconds) or self._stop_grace_s
            await self.stop_job(command.preempt_job.job_id, PREEMPTED, command.preempt_job.reason, grace)
        elif kind == "cancel_job":
            await self.stop_job(
                command.cancel_job.job_id, CANCELLED, command.cancel_job.reason, self._stop_grace_s
            )
        else:
            log.warning("agent.unexpected_command", kind=kind)

    async def start_job(self, command: scheduler_pb2.StartJob) -> None:
        """Record the attempt and launch it; a command this node cannot honour is recorded and
        reported FAILED with the reason, naming the field."""
        job_id, attempt = command.job.id, int(command.attempt)
        if not _JOB_ID.match(job_id):
            log.error("agent.bad_start_job", job_id=job_id)
            if job_id:
                message = "start_job.job.id: must be 1-128 letters, digits, '.', '_' or '-'"
                update = scheduler_pb2.JobStatusUpdate(
                    job_id=job_id, state=FAILED, message=message, exit_code=NO_EXIT_CODE
                )
                self._emit(StatusReport(job_id=job_id, attempt=attempt, version=None, update=update))
            return
        async with self._lock(job_id):
            current = self._active.get(job_id)
            if current is not None and current.attempt == attempt:
                log.info("agent.duplicate_start_job", job_id=job_id, attempt=attempt)
                return
            if current is not None:
                await self._stop(current, PREEMPTED, f"superseded by attempt {attempt}", self._stop_grace_s)
            if await self._store.get(job_id, attempt) is not None:
                log.info("agent.attempt_already_ran", job_id=job_id, attempt=attempt)
                return
            await self._launch(command)

    async def stop_job(self, job_id: str, state: int, reason: str, grace_s: float) -> None:
        """Stop a job's live attempt (SIGTERM, then SIGKILL after ``grace_s``) and record
        ``state``; a job with no live attempt here is left as it is."""
        active = self._active.get(job_id)
        if active is None:
            log.info("agent.stop_unknown_job", job_id=job_id, state=JobState.Name(state))  # type: ignore[arg-type]
            return
        await self._stop(active, state, reason, grace_s)

    async def _stop(self, active: _Active, state: int, reason: str, grace_s: float) -> None:
        # Cancellation is final; it wins over a preemption already under way.
        if active.stop_state is None or state == CANCELLED:
            active.stop_state, active.stop_reason = state, reason
        await active.process.stop(grace_s)
        await active.done.wait()

    async def _launch(self, command: scheduler_pb2.StartJob) -> None:
        job_id, attempt, spec = command.job.id, int(command.attempt), command.job.spec
        run_dir = self._runs_dir / job_id
        row = RunRow(
            job_id=job_id,
            attempt=attempt,
            run_id=await self._store.run_id_for(job_id) or f"run-{uuid.uuid4().hex[:12]}",
            state=SCHEDULED,
            version=0,
            reported_version=0,
            command=list(spec.command),
            gpu_indices=list(command.gpu_indices),
            node_rank=command.node_rank,
            num_nodes=command.num_nodes or 1,
            log_path=str(run_dir / f"attempt-{attempt}.log"),
            message="",
            step=0,
            last_checkpoint_uri="",
            last_checkpoint_step=0,
            created_at=self._clock(),
        )
        await self._store.add(row)
        problem = self._check_start(command)
        if problem is not None:
            await self._finish(row, FAILED, problem.message, None)
            return
        # Jobs write checkpoints to the agent's object store unless they name another one.
        env = {"FORGE_OBJECTS_URL": self._objects_url, **spec.env} if self._objects_url else dict(spec.env)
        argv = list(spec.command)
        endpoint = ""
        if spec.kind == scheduler_pb2.JOB_KIND_INFERENCE:
            # A serving replica listens on a port this node assigns; its URL goes to the scheduler.
            port = self._ports()
            argv = with_serve_port(argv, port)
            env = dict(zip(env, with_serve_port(list(env.values()), port), strict=True))
            env[SERVE_PORT_ENV] = str(port)
            endpoint = f"http://{self._advertise}:{port}"
        launch = LaunchSpec(
            job_id=job_id,
            attempt=attempt,
            command=tuple(argv),
            env=env,
            gpu_indices=tuple(command.gpu_indices),
            node_rank=command.node_rank,
            num_nodes=command.num_nodes or 1,
            master_addr=command.master_addr,
            master_port=command.master_port,
            run_dir=run_dir,
            log_path=Path(row.log_path),
            # The host's network only for a replica an admin (the orchestrator's deployments)
            # submitted: a team's own inference job keeps the private network of any team job.
            serving=spec.kind == scheduler_pb2.JOB_KIND_INFERENCE and command.submitted_by_admin,
        )
        metrics_from = attempt_offset(run_dir)
        try:
            process = await self._runner.launch(launch)
        except LaunchError as exc:
            await self._finish(row, FAILED, str(exc), exc.exit_code)
            return
        active = _Active(
            job_id=job_id,
            attempt=attempt,
            process=process,
            max_runtime_s=float(spec.max_runtime_seconds) or None,
            gpu_indices=frozenset(command.gpu_indices),
        )
        self._active[job_id] = active
        if endpoint:
            self._endpoints[job_id] = endpoint
        RUNS_ACTIVE.set(len(self._active))
        row = await self._store.update(
            job_id,
            attempt,
            state=RUNNING,
            pid=process.pid,
            started_at=self._clock(),
            message=f"running as pid {process.pid}" + (f", serving on {endpoint}" if endpoint else ""),
        )
        self._emit(self._report(row))
        log.info(
            "agent.job_started",
            job_id=job_id,
            attempt=attempt,
            pid=process.pid,
            gpus=list(command.gpu_indices),
        )
        if self._metrics is not None:
            active.metrics = self._spawn(
                self._metrics.follow(job_id, row.run_id, run_dir, active.done, metrics_from),
                name=f"metrics-{job_id}",
            )
        active.supervisor = self._spawn(self._supervise(active), name=f"supervise-{job_id}")

    def _check_start(self, command: scheduler_pb2.StartJob) -> errors.ValidationError | None:
        if not command.job.spec.command:
            return errors.ValidationError("start_job.job.spec.command", "must not be empty")
        isolation = self.node.isolation
        if isolation is not None and (refusal := isolation.refusal(command.submitted_by_admin)):
            return errors.ValidationError("start_job.submitted_by_admin", refusal)
        indices = list(command.gpu_indices)
        known = {g.index for g in self.node.gpus}
        if unknown := sorted(set(indices) - known):
            return errors.ValidationError(
                "start_job.gpu_indices",
                f"{unknown} are not GPUs of node {self.node.name} (it has {sorted(known)})",
            )
        if len(set(indices)) != len(indices):
            return errors.ValidationError("start_job.gpu_indices", f"lists a GPU twice: {indices}")
        busy = {i for a in self._active.values() if a.job_id != command.job.id for i in a.gpu_indices}
        if taken := sorted(busy & set(indices)):
            return errors.ValidationError("start_job.gpu_indices", f"{taken} are in use by another job")
        return None

    async def _supervise(self, active: _Active) -> None:
        """Wait for the attempt's process (stopping it at its runtime limit) and record how it ended."""
        try:
            try:
                status = await asyncio.wait_for(
                    asyncio.shield(active.process.wait()), timeout=active.max_runtime_s
                )
            except TimeoutError:
                if active.stop_state is None:
                    active.stop_state = FAILED
                    active.stop_reason = f"exceeded max_runtime_seconds={active.max_runtime_s:g}"
                status = await active.process.stop(self._stop_grace_s)
            row = await self._store.get(active.job_id, active.attempt)
            assert row is not None
            state, message = self._outcome(active, status, row.log_path)
            await self._finish(row, state, message, status.code)
        finally:
            if self._active.get(active.job_id) is active:
                del self._active[active.job_id]
                self._endpoints.pop(active.job_id, None)
            RUNS_ACTIVE.set(len(self._active))
            active.done.set()

    @staticmethod
    def _outcome(active: _Active, status: ExitStatus, log_path: str) -> tuple[int, str]:
        if active.stop_state is not None:
            return active.stop_state, f"{active.stop_reason or 'stopped'} ({status.describe()})"
        if status.code == 0:
            return SUCCEEDED, status.describe()
        reason = _failure_reason(log_path)
        return FAILED, f"{status.describe()}: {reason}" if reason else status.describe()

    async def _finish(self, row: RunRow, state: int, message: str, exit_code: int | None) -> None:
        if self._announcer is not None and state in (SUCCEEDED, PREEMPTED):
            try:
                await self._announcer.announce(row, self._runs_dir / row.job_id)
            except Exception:
                log.exception("agent.checkpoint_announce_failed", job_id=row.job_id)
        row = await self._store.update(
            row.job_id,
            row.attempt,
            state=state,
            message=message[-MESSAGE_LIMIT:],
            exit_code=exit_code,
            finished_at=self._clock(),
        )
        state_name = JobState.Name(state)  # type: ignore[arg-type]
        RUNS_FINISHED.labels(state_name).inc()
        log.info(
            "agent.job_finished",
            job_id=row.job_id,
            attempt=row.attempt,
            state=state_name,
            exit_code=exit_code,
        )
        self._emit(self._report(row))

    # --- queries -----------------------------------------------------------------------------

    def export_dir(self, job_id: str) -> Path | None:
        """The job's Hugging Face export on this node (written by its rank-0 replica), if any."""
        export = self._runs_dir / job_id / "hf"
        return export.resolve() if (export / "config.json").exists() else None

    async def node_status(self) -> NodeStatus:
        return NodeStatus(
            node=self.node, node_id=self.node_id, connected=self.connected, running=await self._store.active()
        )

    async def list_runs(self, job_id: str, page_size: int, offset: int) -> tuple[list[RunRow], int]:
        return await self._store.list_latest([job_id] if job_id else [], page_size, offset)

    # --- lifecycle ---------------------------------------------------------------------------

    async def recover(self) -> None:
        """At start-up: an attempt recorded as active belongs to an earlier agent process, which
        can no longer supervise it. Stop what is left of it and record it FAILED (the scheduler
        re-queues the job) rather than leave it holding GPUs unseen."""
        for row in await self._store.active():
            if row.job_id in self._active:
                continue
            if row.pid and _process_of_job(row.pid, row.job_id):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(row.pid, signal.SIGKILL)
            await self._finish(
                row, FAILED, "the trainer agent restarted while this attempt ran; it was stopped", None
            )

    async def shutdown(self, grace_s: float) -> None:
        """The agent is stopping: preempt every live attempt (they checkpoint and exit) and wait."""
        live = list(self._active.values())
        await asyncio.gather(
            *(self._stop(a, PREEMPTED, "the trainer agent is stopping", grace_s) for a in live),
            return_exceptions=True,
        )
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _lock(self, job_id: str) -> asyncio.Lock:
        return self._locks.setdefault(job_id, asyncio.Lock())

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.create_task(self._logged(coro), name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    @staticmethod
    async def _logged(coro: Coroutine[Any, Any, None]) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception:  # a failed command must not take the agent down; it is logged
            log.exception("agent.task_failed")
