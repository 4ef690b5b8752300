"""A full disk under a training job's checkpoint folder (``checkpoint_disk_full``).

The job is the process a trainer agent starts (``python -m forge_training.run``, the smoke recipe,
a checkpoint every ``INTERVAL`` steps, its termination log where the agent reads the failure's
reason) with its object store on a tmpfs of its own. Once the job has published its first
checkpoints, another tenant fills that disk, leaving a few MiB free: less than a checkpoint, so
the next save fills the disk partway through its shard. The disk stays full until the job has
ended, then is given back, and the job is started again under the same run id (what the agent does
for a requeued attempt). Afterwards:

* the first run failed, and its reason (the termination log) says the disk is full and which
  step's checkpoint was not written — a clear error, not a bare traceback;
* every step folder in the store either holds a complete checkpoint (manifest present, every
  file's size and sha256 as listed) or has no manifest at all: nothing half-published;
* the second run resumed from the newest complete checkpoint (``check_resumes``: never a torn
  one, never an older one), chained its next checkpoint to it, and ran to the end;
* recovery: from the disk given back to the resumed run's first checkpoint (the step the full
  disk refused).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from faultkit.history import History, check_resumes, verdict
from faultkit.host import SizedMount
from faultkit.scenario import Targets, load_scenario, run_timeline

from forge_kit.paths import data_dir
from forge_kit.testing.requires import missing

pytestmark = [pytest.mark.integration, pytest.mark.faults_full, pytest.mark.timeout(300)]
RUN_ID = "ckpt-full"
MAX_STEPS = 150  # several seconds of the smoke recipe: the fault lands well before the end
INTERVAL = 10
KEEP = 8  # 8 of 1.5 MB and one being written fit the disk
DISK_BYTES = 16 * 1024 * 1024  # a smoke checkpoint is about 1.5 MB
STEP_DIR = re.compile(r"^step-(\d{8})$")


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[SizedMount]:
    if why := SizedMount.available():
        missing(why)
    mount = SizedMount(tmp_path / "objects", DISK_BYTES).mount()
    try:
        yield mount
    finally:
        mount.unmount()


def job(tmp_path: Path, attempt: int) -> subprocess.Popen[bytes]:
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    termination = run_dir / f"termination-{attempt}.log"
    argv = [
        sys.executable, "-m", "forge_training.run", "--recipe", "smoke",
        "--set", f"max_steps={MAX_STEPS}", "--set", f"checkpoint.interval_steps={INTERVAL}",
        "--set", f"checkpoint.keep_last={KEEP}", "--set", f"eval_interval={MAX_STEPS}",
        "--run-id", RUN_ID, "--run-dir", str(run_dir), "--objects", str(tmp_path / "objects"),
    ]  # fmt: skip
    env = {**os.environ, "FORGE_TERMINATION_LOG": str(termination), "FORGE_DATA_DIR": str(data_dir())}
    log = (run_dir / f"attempt-{attempt}.log").open("wb")
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)


def checkpoints(objects: Path) -> dict[int, str]:
    """step → ``complete`` (manifest present, every file as it lists), ``torn`` (no manifest) or
    ``corrupt: why`` (a manifest whose files do not match: published and wrong)."""
    found: dict[int, str] = {}
    base = objects / "checkpoints" / RUN_ID
    for folder in sorted(base.iterdir()) if base.exists() else []:
        match = STEP_DIR.match(folder.name)
        if not match:
            continue
        step = int(match.group(1))
        manifest = folder / "manifest.json"
        if not manifest.exists():
            found[step] = "torn"
            continue
        try:
            files = json.loads(manifest.read_text())["files"]
        except (ValueError, KeyError) as exc:
            found[step] = f"corrupt: unreadable manifest ({exc})"
            continue
        found[step] = "complete"
        for key, expect in files.items():
            path = objects / key
            data = path.read_bytes() if path.exists() else b""
            if len(data) != expect["size"] or hashlib.sha256(data).hexdigest() != expect["sha256"]:
                found[step] = f"corrupt: {key} does not match the manifest"
    return found


def complete(objects: Path) -> list[int]:
    return sorted(s for s, state in checkpoints(objects).items() if state == "complete")


async def first_manifest(path: Path) -> tuple[dict[str, object], float]:
    """The meta of the manifest at ``path`` once it appears (before retention drops it), and when."""
    while True:
        try:
            body = json.loads(path.read_text())
            return dict(body["meta"]), path.stat().st_mtime
        except (OSError, ValueError):
            await asyncio.sleep(0.05)


async def wait_exit(process: subprocess.Popen[bytes], timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while process.poll() is None:
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"the job did not end in {timeout_s}s")
        await asyncio.sleep(0.2)
    return int(process.returncode)


@pytest.mark.asyncio
async def test_full_checkpoint_disk_fails_clearly_and_resume_takes_the_last_complete(
    tmp_path: Path, disk: SizedMount
) -> None:
    scenario = load_scenario("checkpoint_disk_full")
    history = History()
    objects = tmp_path / "objects"
    # 1. The job runs until it has published two checkpoints.
    first = job(tmp_path, 1)
    deadline = time.monotonic() + 180
    while len(complete(objects)) < 2:
        assert first.poll() is None, (tmp_path / "run" / "attempt-1.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint before the fault"
        await asyncio.sleep(0.1)
    # 2. The disk fills (a few MiB left) and stays full until the job has ended.
    timeline = asyncio.create_task(run_timeline(scenario, Targets(links={}, mounts={"checkpoints": disk})))
    code = await wait_exit(first, 180)
    before = checkpoints(objects)
    timeline.cancel()  # gives the disk back (run_timeline heals on cancellation)
    await asyncio.gather(timeline, return_exceptions=True)
    freed = time.time()
    reason = (tmp_path / "run" / "termination-1.log").read_text() if code else ""
    last_complete = max(s for s, state in before.items() if state == "complete")
    op = history.invoke("job-1", "checkpoint", RUN_ID, last_complete + INTERVAL)
    history.fail(op, reason) if code else history.ok(op)

    # 3. Started again under the same run id, it resumes and runs to the end.
    second = job(tmp_path, 2)
    following = objects / "checkpoints" / RUN_ID / f"step-{last_complete + INTERVAL:08d}" / "manifest.json"
    watcher = asyncio.create_task(first_manifest(following))
    code_2 = await wait_exit(second, 240)
    watcher.cancel()
    seen = await asyncio.gather(watcher, return_exceptions=True)
    next_meta, recovery = seen[0] if isinstance(seen[0], tuple) else ({}, float("nan"))
    recovery -= freed
    log_2 = (tmp_path / "run" / "attempt-2.log").read_text()
    resumed = re.search(r"train\.resumed\W.*?step\W+(\d+)", log_2)
    op = history.invoke("job-2", "resume", RUN_ID)
    history.ok(op, int(resumed.group(1))) if resumed else history.info(op, "no train.resumed in the log")
    after = checkpoints(objects)
    history.dump(tmp_path / "checkpoint_disk_full.history.jsonl")
    result = verdict(history, check_resumes(history, "resume", {RUN_ID: before}))
    print(
        f"\nfault checkpoint_disk_full: {len(before)} step folders at the failure "
        f"({sum(v == 'torn' for v in before.values())} torn, {sum(v == 'complete' for v in before.values())} "
        f"complete), first run exit {code}: {reason.strip()[:200]!r}; resumed from step "
        f"{int(resumed.group(1)) if resumed else '?'}, exit {code_2}; first checkpoint after the resume "
        f"{recovery:.1f}s after the disk was given back; "
        f"{result.ops_checked} operations checked, anomalies {len(result.anomalies)}"
    )
    result.assert_valid()
    assert code != 0, "the first run ended well on a full disk"
    assert "storage is full" in reason and f"step {last_complete + INTERVAL}" in reason, reason
    assert not [s for s, v in {**before, **after}.items() if v.startswith("corrupt")], (before, after)
    assert code_2 == 0, log_2[-3000:]
    assert MAX_STEPS in complete(objects)
    # The resumed run's first checkpoint (the step the full disk refused) names the one it came from.
    assert next_meta.get("parent", "").endswith(f"step-{last_complete:08d}/manifest.json"), next_meta
