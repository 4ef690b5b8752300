"""Jobs in the bubblewrap sandbox: stopping still lets them checkpoint, and the main job's shape
(two replicas on two agents of one host, c10d over loopback, shared-memory all-reduce, checkpoints
into the object store) still trains as the unprivileged job user."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from forge_kit.paths import resolve_data_path
from forge_kit.testing import eventually, free_port
from forge_trainer_agent.runner import ExitStatus, LaunchSpec, LocalProcessRunner, TorchrunRunner
from forge_trainer_agent.sandbox import JobIsolation, JobSandbox, dataset_folders
from forge_training import schema

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox drops privileges only from root")


@pytest.fixture(autouse=True)
def _shm_folders() -> Iterator[None]:
    """The per-job shm folders stay after a job (another replica may use them): tidy ours."""
    yield
    for job_id in ("job-t", "job-s", "job-env", "job-new", "job-ddp"):
        with contextlib.suppress(OSError):
            (Path("/dev/shm") / f"forge-job-{job_id}").rmdir()


def sandbox(tmp_path: Path, **kw: object) -> JobSandbox:
    kw.setdefault("private", [tmp_path / "agent"])
    return JobSandbox(bwrap="/usr/bin/bwrap", uid=65534, gid=65534, **kw)  # type: ignore[arg-type]


def test_the_probe_reports_isolation_and_a_missing_bwrap(tmp_path: Path) -> None:
    assert sandbox(tmp_path).check().isolated
    missing = JobSandbox(bwrap=str(tmp_path / "nope"), uid=65534, gid=65534).check()
    assert not missing.isolated and "nope not found (Debian package bubblewrap)" in missing.detail
    assert missing.refusal(submitted_by_admin=False) and not missing.refusal(submitted_by_admin=True)
    assert not JobIsolation(False, "x", allows_unisolated=True).refusal(submitted_by_admin=False)
    with pytest.raises(ValueError, match="root"):
        JobSandbox(bwrap="/usr/bin/bwrap", uid=0, gid=0)


def test_agents_starting_together_each_probe_their_own_sandbox(tmp_path: Path) -> None:
    # `forge up` starts its agents at once; probes sharing one /dev/shm folder removed it under
    # each other ("Can't find source path /dev/shm/forge-job-probe").
    probes = [sandbox(tmp_path / str(i)) for i in range(4)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda s: s.check(), probes * 3))
    assert all(r.isolated for r in results), [r.detail for r in results if not r.isolated]


async def test_stop_reaches_the_job_in_the_sandbox_which_exits_in_its_grace(tmp_path: Path) -> None:
    code = (
        "import os, signal, sys, time\n"
        "def leave(*_):\n"
        "    time.sleep(0.5); open('saved', 'w').write(str(os.getuid())); sys.exit(3)\n"
        "signal.signal(signal.SIGTERM, leave)\n"
        "open('ready', 'w').close()\n"
        "time.sleep(60)\n"
    )
    run_dir = tmp_path / "runs" / "job-t"
    spec = LaunchSpec(job_id="job-t", attempt=1, command=(sys.executable, "-c", code), run_dir=run_dir,
                      log_path=run_dir / "attempt-1.log")  # fmt: skip
    runner = LocalProcessRunner(sandbox=sandbox(tmp_path))
    proc = await runner.launch(spec)
    await eventually((run_dir / "ready").exists, what="the job to install its SIGTERM handler")
    status = await proc.stop(grace_s=20)
    assert status == ExitStatus(code=3), (run_dir / "attempt-1.log").read_text()
    assert (run_dir / "saved").read_text() == "65534"
    # A command that keeps SIGTERM's default action dies of it, and is reported so.
    sleeping = tmp_path / "runs" / "job-s"
    spec = LaunchSpec(job_id="job-s", attempt=1, command=("sleep", "60"), run_dir=sleeping,
                      log_path=sleeping / "attempt-1.log")  # fmt: skip
    sleeper = await runner.launch(spec)
    await asyncio.sleep(0.5)
    assert (await sleeper.stop(grace_s=20)).signal == signal.SIGTERM


@pytest.mark.integration
async def test_two_sandboxed_replicas_on_two_agents_train_and_checkpoint_as_the_job_user(
    tmp_path: Path,
) -> None:
    corpus = tmp_path / "data" / "shakespeare.txt"
    corpus.parent.mkdir()
    corpus.write_text(
        resolve_data_path(schema.DEFAULT_CORPUS).read_text(encoding="utf-8")[:40_000], encoding="utf-8"
    )
    objects = tmp_path / "objects"
    objects.mkdir()
    job_id, port = "job-ddp", free_port()
    command = (sys.executable, "-m", "forge_training.run", "--recipe", "smoke",
               "--set", f"data.corpus={corpus}", "--set", "threads=1", "--set", "max_steps=4",
               "--set", "eval_interval=4", "--set", "checkpoint.interval_steps=2")  # fmt: skip
    launched = []
    for rank in (0, 1):
        box = sandbox(tmp_path / f"agent-{rank}", read_paths=[str(corpus.parent)], objects_root=str(objects))
        run_dir = tmp_path / f"agent-{rank}" / "runs" / job_id
        spec = LaunchSpec(job_id=job_id, attempt=1, command=command, env={"FORGE_OBJECTS_URL": str(objects)},
                          gpu_indices=(0,), node_rank=rank, num_nodes=2, master_addr="127.0.0.1",
                          master_port=port, run_dir=run_dir, log_path=run_dir / "attempt-1.log")  # fmt: skip
        launched.append((spec, await TorchrunRunner(sandbox=box).launch(spec)))
    statuses = await asyncio.wait_for(asyncio.gather(*(p.wait() for _, p in launched)), timeout=280)
    logs = [spec.log_path.read_text() for spec, _ in launched]
    assert statuses == [ExitStatus(code=0), ExitStatus(code=0)], "\n".join(log[-3000:] for log in logs)
    assert "allreduce.shared_memory" in logs[0] and "shared_memory_unavailable" not in logs[0]
    summary = json.loads([ln for ln in logs[0].splitlines() if ln.startswith("{")][-1])
    assert summary["outcome"] == "succeeded" and summary["step"] == 4
    manifest = objects / "checkpoints" / job_id / "step-00000004" / "manifest.json"
    assert json.loads(manifest.read_text())["world_size"] == 2
    assert manifest.stat().st_uid == 65534 and launched[0][0].run_dir.stat().st_uid == 65534
    shm = Path("/dev/shm") / f"forge-job-{job_id}"
    assert list(shm.iterdir()) == [] and shm.stat().st_uid == 65534  # the segment was unlinked


async def test_read_globs_and_write_paths_reach_the_job_and_nothing_else(tmp_path: Path) -> None:
    """Another agent's run folders are readable through a glob, a shared results folder is
    writable, and the agent's own database next to its runs is not there at all."""
    other = tmp_path / "var" / "data" / "trainer_agent_2" / "runs" / "job-old" / "hf"
    other.mkdir(parents=True)
    (other / "config.json").write_text("{}")
    agent = tmp_path / "var" / "data" / "trainer_agent"
    (agent / "runs").mkdir(parents=True)
    (agent / "trainer_agent.db").write_text("rows")
    results = tmp_path / "var" / "objects" / "rlhf"
    box = sandbox(
        tmp_path,
        read_paths=[str(tmp_path / "var" / "data" / "trainer_agent*" / "runs")],
        write_paths=[str(results)],
        private=[agent],
    )
    code = (
        "import os, sys\n"
        "print(open(sys.argv[1]).read(), os.path.exists(sys.argv[2]))\n"
        "open(os.path.join(sys.argv[3], 'out.json'), 'w').write('ok')\n"
    )
    run_dir = agent / "runs" / "job-new"
    spec = LaunchSpec(job_id="job-new", attempt=1, run_dir=run_dir, log_path=run_dir / "attempt-1.log",
                      command=(sys.executable, "-c", code, str(other / "config.json"),
                               str(agent / "trainer_agent.db"), str(results)))  # fmt: skip
    status = await (await LocalProcessRunner(sandbox=box).launch(spec)).wait()
    log = spec.log_path.read_text()
    assert status == ExitStatus(code=0), log
    assert log.strip() == "{} False"
    assert (results / "out.json").read_text() == "ok" and results.stat().st_uid == 65534


async def test_the_jobs_environment_never_reaches_the_processes_that_run_as_root(tmp_path: Path) -> None:
    """bubblewrap and setpriv run as root: a job-declared ``LD_PRELOAD`` in their environment
    would load the job's code as root. They get only PATH and the job id; the job gets its env."""
    run_dir = tmp_path / "runs" / "job-env"
    code = "import os, time; open('env', 'w').write(os.environ['LD_PRELOAD']); time.sleep(60)"
    spec = LaunchSpec(job_id="job-env", attempt=1, command=(sys.executable, "-c", code), run_dir=run_dir,
                      env={"LD_PRELOAD": "/nonexistent/evil.so", "JOB_SECRET": "s3"},
                      log_path=run_dir / "attempt-1.log")  # fmt: skip
    proc = await LocalProcessRunner(sandbox=sandbox(tmp_path)).launch(spec)
    try:
        # Read once written: open() makes the file before write() fills it (seen empty under load).
        written = lambda: (run_dir / "env").exists() and (run_dir / "env").read_text()  # noqa: E731
        assert await eventually(written, what="the job to write its environment") == "/nonexistent/evil.so"
        launcher = Path(f"/proc/{proc.pid}")
        assert launcher.stat().st_uid == 0
        environ = launcher.joinpath("environ").read_bytes().split(b"\0")
        assert b"FORGE_JOB_ID=job-env" in environ
        assert not [v for v in environ if v.startswith((b"LD_PRELOAD", b"JOB_SECRET"))]
        assert b"s3" not in launcher.joinpath("cmdline").read_bytes()
    finally:
        await proc.stop(grace_s=5)


def test_jobs_read_the_datasets_but_not_the_data_folder_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The data folder may hold services' state next to the datasets (``var/data/<service>``)."""
    monkeypatch.setenv("FORGE_DATA_DIR", str(tmp_path / "data"))
    folders = dataset_folders()
    assert tmp_path / "data" / "corpora" in folders and tmp_path / "data" not in folders
    (tmp_path / "data" / "corpora").mkdir(parents=True)
    (tmp_path / "data" / "scheduler").mkdir()
    plan = sandbox(tmp_path, read_paths=[str(p) for p in folders]).plan(tmp_path / "run", "job-d")
    assert tmp_path / "data" / "corpora" in plan.read_only
    assert not any(p == tmp_path / "data" or p == tmp_path / "data" / "scheduler" for p in plan.read_only)


def test_a_job_on_one_node_gets_a_network_of_its_own(tmp_path: Path) -> None:
    """One node: only its own loopback (collectives told to use it); spread over nodes, serving,
    or with an object store over the network: the host's network."""
    box = sandbox(tmp_path)
    one = box.plan(tmp_path / "run", "job-n")
    assert one.private_network
    assert not box.plan(tmp_path / "run", "job-n", num_nodes=2).private_network
    # A serving replica: the gateway reaches it at the port the agent assigned; it reads /sys
    # (vLLM's CPU worker runs lscpu), which other jobs without GPUs do not see.
    serving = box.plan(tmp_path / "run", "job-n", serving=True)
    assert not serving.private_network
    assert "/sys" in box.launch(serving, ["true"], {}, 3, 4).args.decode().split("\0")
    assert "/sys" not in box.launch(one, ["true"], {}, 3, 4).args.decode().split("\0")
    assert (
        not sandbox(tmp_path, objects_root="s3://bucket/forge")
        .plan(tmp_path / "run", "job-n")
        .private_network
    )
    launch = box.launch(one, ["true"], {"NCCL_SOCKET_IFNAME": "eth0", "JOB": "x"}, 3, 4)
    assert "--unshare-net" in launch.args.decode().split("\0")
    assert "NCCL_SOCKET_IFNAME=lo" in launch.script.decode() and "JOB=x" in launch.script.decode()
    spread = box.launch(
        box.plan(tmp_path / "run", "job-n", 2), ["true"], {"NCCL_SOCKET_IFNAME": "eth0"}, 3, 4
    )
    assert "--unshare-net" not in spread.args.decode().split("\0")
    assert "NCCL_SOCKET_IFNAME=eth0" in spread.script.decode()
