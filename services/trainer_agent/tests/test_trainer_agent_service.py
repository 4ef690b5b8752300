"""The agent's command handling on real local processes: start, finish, fail, preempt, cancel,
record, and report — driven through ``AgentService.handle`` as the session would."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from forge.common.v1 import common_pb2
from forge.scheduler.v1 import scheduler_pb2

from forge_trainer_agent.node import NodeInfo
from forge_trainer_agent.runner import LaunchSpec, TorchrunRunner, job_environment
from forge_trainer_agent.service import AgentService
from forge_trainer_agent.store import RunRow, RunStore

PY = sys.executable
RUNNING, SUCCEEDED, FAILED = (
    common_pb2.JOB_STATE_RUNNING,
    common_pb2.JOB_STATE_SUCCEEDED,
    common_pb2.JOB_STATE_FAILED,
)
PREEMPTED, CANCELLED = common_pb2.JOB_STATE_PREEMPTED, common_pb2.JOB_STATE_CANCELLED
SCHEDULED = common_pb2.JOB_STATE_SCHEDULED
# Installs a SIGTERM handler that ignores the signal, then says so: only SIGKILL ends it.
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
SLEEPER = "import time; print('ready', flush=True); time.sleep(60)"


def start(job: scheduler_pb2.StartJob) -> scheduler_pb2.AgentSessionResponse:
    return scheduler_pb2.AgentSessionResponse(start_job=job)


async def wait_for_log(path: str, text: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.path.exists(path) and text in Path(path).read_text():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{text!r} never appeared in {path}")


async def test_successful_job_runs_with_its_environment_and_reports_running_then_succeeded(
    agent: AgentService, store: RunStore, start_job, reports_until
) -> None:
    code = "import os; print(os.environ['FORGE_JOB_ID'], os.environ['CUDA_VISIBLE_DEVICES'], os.environ['GREETING'], os.environ['RANK'], os.getcwd())"
    await agent.handle(
        start(start_job("job-ok", [PY, "-c", code], gpus=[1], env={"GREETING": "hi"}, node_rank=0))
    )

    reports = await reports_until("job-ok")

    assert [(r.update.state, r.update.exit_code) for r in reports] == [(RUNNING, 0), (SUCCEEDED, 0)]
    row = await store.get("job-ok", 1)
    assert row is not None and row.state == SUCCEEDED and row.exit_code == 0 and row.pid
    assert row.finished_at is not None and row.started_at is not None
    run_dir = agent._runs_dir / "job-ok"
    assert row.log_path == str(run_dir / "attempt-1.log")
    assert Path(row.log_path).read_text().split() == ["job-ok", "1", "hi", "0", str(run_dir)]
    assert agent.running_job_ids() == []


async def test_failing_job_reports_its_exit_code_and_the_tail_of_its_output(
    agent: AgentService, store: RunStore, start_job, reports_until
) -> None:
    code = "import sys; print('loading data'); sys.stderr.write('ValueError: bad shard 7\\n'); sys.exit(3)"
    await agent.handle(start(start_job("job-bad", [PY, "-c", code])))

    reports = await reports_until("job-bad")

    final = reports[-1].update
    assert final.state == FAILED and final.exit_code == 3
    assert final.message.startswith("exited with code 3") and "ValueError: bad shard 7" in final.message
    row = await store.get("job-bad", 1)
    assert row is not None and (row.state, row.exit_code) == (FAILED, 3)


async def test_a_failing_job_names_its_reason_through_the_termination_log(
    agent: AgentService, start_job, reports_until
) -> None:
    code = (
        "import os, sys; open(os.environ['FORGE_TERMINATION_LOG'], 'w').write('shard 7 is torn'); "
        "print('a summary printed after the reason'); sys.exit(3)"
    )
    await agent.handle(start(start_job("job-said", [PY, "-c", code])))

    final = (await reports_until("job-said"))[-1].update

    assert (final.state, final.exit_code) == (FAILED, 3)
    assert final.message == "exited with code 3: shard 7 is torn"


@pytest.mark.integration
async def test_a_recipe_refused_under_torchrun_is_the_failure_message(
    store: RunStore, node: NodeInfo, tmp_path: Path, start_job
) -> None:
    """torchrun ends the log with its own failure summary; the attempt's message is still the
    worker's reason, from the termination log."""
    agent = AgentService(store, TorchrunRunner(), node, runs_dir=tmp_path / "runs", stop_grace_s=5.0)
    job = start_job("job-refused", [PY, "-m", "forge_training.run", "--recipe", "smoke"])
    job.master_addr = ""  # one node: torchrun --standalone
    job.job.spec.command.extend(["--set", "optim.no_such_field=1"])
    try:
        await agent.handle(start(job))
        deadline = time.monotonic() + 60
        while (row := await store.get("job-refused", 1)) is None or row.state in (SCHEDULED, RUNNING):
            assert time.monotonic() < deadline, "the refused job never finished"
            await asyncio.sleep(0.1)
    finally:
        await agent.shutdown(grace_s=0)

    assert row.state == FAILED and row.exit_code != 0
    assert "recipe refused:" in row.message and "no_such_field" in row.message
    assert "recipe refused:" not in "\n".join(Path(row.log_path).read_text().splitlines()[-5:])


async def test_preempting_a_sleeping_job_stops_it_well_within_grace(
    agent: AgentService, store: RunStore, start_job, reports_until
) -> None:
    await agent.handle(start(start_job("job-sleep", [PY, "-c", SLEEPER])))
    row = await store.get("job-sleep", 1)
    assert row is not None and row.pid
    await wait_for_log(row.log_path, "ready")
    preempt = scheduler_pb2.PreemptJob(job_id="job-sleep", reason="reclaimed by team prod", grace_seconds=10)

    began = time.monotonic()
    await agent.handle(scheduler_pb2.AgentSessionResponse(preempt_job=preempt))
    elapsed = time.monotonic() - began

    assert elapsed < 5, "SIGTERM ends a sleeping process long before the grace period"
    final = (await reports_until("job-sleep"))[-1].update
    assert final.state == PREEMPTED and final.exit_code == 128 + 15
    assert final.message.startswith("reclaimed by team prod")
    with pytest.raises(ProcessLookupError):
        os.kill(row.pid, 0)


async def test_a_job_that_ignores_sigterm_is_killed_after_the_grace_period(
    agent: AgentService, store: RunStore, start_job, reports_until
) -> None:
    await agent.handle(start(start_job("job-stubborn", [PY, "-c", STUBBORN])))
    row = await store.get("job-stubborn", 1)
    assert row is not None
    await wait_for_log(row.log_path, "ready")

    began = time.monotonic()
    await agent.stop_job("job-stubborn", PREEMPTED, "make room", grace_s=0.3)
    elapsed = time.monotonic() - began

    assert 0.3 <= elapsed < 5
    final = (await reports_until("job-stubborn"))[-1].update
    assert (final.state, final.exit_code) == (PREEMPTED, 128 + 9)
    assert "SIGKILL" in final.message


async def test_cancel_stops_the_job_and_records_cancelled(
    agent: AgentService, store: RunStore, start_job, reports_until
) -> None:
    await agent.handle(start(start_job("job-cancel", [PY, "-c", SLEEPER])))
    cancel = scheduler_pb2.CancelJob(job_id="job-cancel", reason="user asked")
    await agent.handle(scheduler_pb2.AgentSessionResponse(cancel_job=cancel))

    final = (await reports_until("job-cancel"))[-1].update
    assert final.state == CANCELLED and final.message.startswith("user asked")
    row = await store.get("job-cancel", 1)
    assert row is not None and row.state == CANCELLED


async def test_runtime_limit_fails_the_job(agent: AgentService, start_job, reports_until) -> None:
    await agent.handle(start(start_job("job-slow", [PY, "-c", SLEEPER], max_runtime_s=1)))

    final = (await reports_until("job-slow"))[-1].update

    assert final.state == FAILED and final.message.startswith("exceeded max_runtime_seconds=1")


async def test_missing_command_binary_fails_with_127(
    agent: AgentService, store: RunStore, start_job, reports_until
) -> None:
    await agent.handle(start(start_job("job-missing", ["/nonexistent/forge-train"])))

    final = (await reports_until("job-missing"))[-1].update

    assert (final.state, final.exit_code) == (FAILED, 127)
    assert "command not found" in final.message
    assert (await store.get("job-missing", 1)) is not None


@pytest.mark.parametrize(
    ("command", "gpus", "field"),
    [
        ([], [0], "start_job.job.spec.command"),
        ([PY, "-c", "pass"], [0, 7], "start_job.gpu_indices"),
        ([PY, "-c", "pass"], [1, 1], "start_job.gpu_indices"),
    ],
)
async def test_a_command_the_node_cannot_honour_is_recorded_and_reported_naming_the_field(
    agent: AgentService,
    store: RunStore,
    start_job,
    reports_until,
    command: list[str],
    gpus: list[int],
    field: str,
) -> None:
    await agent.handle(start(start_job("job-x", command, gpus=gpus)))

    reports = await reports_until("job-x")

    assert [r.update.state for r in reports] == [FAILED]
    assert reports[0].update.message.startswith(f"{field}:") and reports[0].update.exit_code == -1
    row = await store.get("job-x", 1)
    assert row is not None and row.state == FAILED and row.pid is None


async def test_gpus_in_use_by_another_job_are_refused(agent: AgentService, start_job, reports_until) -> None:
    await agent.handle(start(start_job("job-a", [PY, "-c", SLEEPER], gpus=[0])))
    await agent.handle(start(start_job("job-b", [PY, "-c", "pass"], gpus=[0, 1])))

    final = (await reports_until("job-b"))[-1].update

    assert final.state == FAILED and final.message == "start_job.gpu_indices: [0] are in use by another job"
    assert agent.running_job_ids() == ["job-a"]


async def test_a_repeated_start_job_does_not_launch_twice(
    agent: AgentService, store: RunStore, start_job
) -> None:
    command = start(start_job("job-once", [PY, "-c", SLEEPER]))
    await agent.handle(command)
    first = await store.get("job-once", 1)
    await agent.handle(command)

    again = await store.get("job-once", 1)
    assert first is not None and again is not None and again.pid == first.pid
    assert agent.running_job_ids() == ["job-once"]


async def test_a_new_attempt_supersedes_the_old_one_and_keeps_the_run_id(
    agent: AgentService, store: RunStore, start_job, reports_until
) -> None:
    await agent.handle(start(start_job("job-r", [PY, "-c", SLEEPER], attempt=1)))
    await agent.handle(start(start_job("job-r", [PY, "-c", "pass"], attempt=2)))
    await reports_until("job-r")  # attempt 1 ends PREEMPTED

    first, second = await store.get("job-r", 1), await store.get("job-r", 2)
    assert first is not None and second is not None
    assert first.state == PREEMPTED and first.run_id == second.run_id
    runs, total = await agent.list_runs("job-r", 10, 0)
    assert total == 1 and [(r.job_id, r.attempt) for r in runs] == [("job-r", 2)]


async def test_states_reached_while_disconnected_are_sent_after_resync_and_only_once(
    agent: AgentService, start_job, reports_until
) -> None:
    await agent.handle(start(start_job("job-q", [PY, "-c", "pass"])))
    await reports_until("job-q")
    assert await agent.reports() == []

    # A state recorded while no session takes reports …
    await agent.handle(start(start_job("job-late", ["/nonexistent/x"])))
    agent._outbound.clear()  # … is lost from the in-memory queue (as when the session dropped it),
    agent.request_resync()  # … and a new session asks for everything unreported.
    resent = await agent.reports()

    assert [(r.job_id, r.update.state) for r in resent] == [("job-late", FAILED)]
    for report in resent:
        await agent.mark_reported(report)
    agent.request_resync()
    assert await agent.reports() == []


async def test_list_runs_pages_newest_first(agent: AgentService, start_job, reports_until) -> None:
    for name in ("job-1", "job-2", "job-3"):
        await agent.handle(start(start_job(name, [PY, "-c", "pass"])))
        await reports_until(name)

    page1, total = await agent.list_runs("", 2, 0)
    page2, _ = await agent.list_runs("", 2, 2)

    assert total == 3
    assert [r.job_id for r in page1 + page2] == ["job-3", "job-2", "job-1"]


async def test_recover_stops_an_orphan_of_a_previous_agent_and_fails_its_run(
    agent: AgentService, store: RunStore, tmp_path: Path
) -> None:
    orphan = subprocess.Popen(
        [PY, "-c", "import time; time.sleep(60)"],
        env={**os.environ, "FORGE_JOB_ID": "job-orphan"},
        start_new_session=True,
    )
    bystander = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        for job_id, pid in (("job-orphan", orphan.pid), ("job-bystander", bystander.pid)):
            await store.add(
                RunRow(
                    job_id=job_id,
                    attempt=1,
                    run_id=f"run-{job_id}",
                    state=RUNNING,
                    version=1,
                    reported_version=1,
                    pid=pid,
                )
            )

        await agent.recover()

        assert orphan.wait(timeout=30) == -9
        assert bystander.poll() is None, "a process not started for the job is never signalled"
        for job_id in ("job-orphan", "job-bystander"):
            row = await store.get(job_id, 1)
            assert row is not None and row.state == FAILED and "restarted" in row.message
    finally:
        for proc in (orphan, bystander):
            proc.kill()
            proc.wait()


def test_job_environment_keeps_the_agents_secrets_out_and_placement_authoritative(tmp_path: Path) -> None:
    spec = LaunchSpec(
        job_id="job-e",
        attempt=2,
        command=("x",),
        env={"CUDA_VISIBLE_DEVICES": "0,1,2,3", "LR": "3e-4"},
        gpu_indices=(4, 5),
        node_rank=1,
        num_nodes=2,
        master_addr="10.0.0.1",
        master_port=29500,
        run_dir=tmp_path,
    )
    base = {
        "PATH": "/usr/bin",
        "FORGE_TRAINER_AGENT_AUTH_TOKEN": "secret",
        "FORGE_READY_FILE": "/tmp/r",
        # The operator's fabric settings on the agent reach every job (multi-node NCCL, gloo).
        "NCCL_SOCKET_IFNAME": "eth1",
        "NCCL_IB_HCA": "mlx5",
        "GLOO_SOCKET_IFNAME": "eth1",
        "CUDA_DEVICE_ORDER": "FASTEST_FIRST",
    }

    env = job_environment(spec, base)

    assert env["CUDA_VISIBLE_DEVICES"] == "4,5" and env["LR"] == "3e-4" and env["PATH"] == "/usr/bin"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # the agent's (NVML's) numbering, not the job's
    assert (env["NCCL_SOCKET_IFNAME"], env["NCCL_IB_HCA"], env["GLOO_SOCKET_IFNAME"]) == (
        "eth1",
        "mlx5",
        "eth1",
    )
    assert "FORGE_TRAINER_AGENT_AUTH_TOKEN" not in env and "FORGE_READY_FILE" not in env
    assert (env["FORGE_JOB_ID"], env["FORGE_ATTEMPT"], env["NODE_RANK"], env["NNODES"]) == (
        "job-e",
        "2",
        "1",
        "2",
    )
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "29500")
