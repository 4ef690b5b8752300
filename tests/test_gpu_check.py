"""``load/gpu_check.sh --dry-run``: without a GPU, every file, module and tool the GPU check
would use is there (so the one command a GPU machine runs is not first tried on the GPU)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "load" / "gpu_check.sh"


def _dry_run(python: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FORGE_PY": python}
    return subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, env=env, timeout=600, cwd="/"
    )


def test_the_dry_run_finds_everything_the_gpu_check_uses() -> None:
    done = _dry_run(sys.executable)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ok: module forge_trainer_agent.gpus" in done.stderr
    assert "ok: the trainer takes the check's settings (DDP and FSDP on 2 ranks, bf16)" in done.stderr
    assert "ok: the planner predicts the check's shape" in done.stderr
    assert "checks passed" in done.stderr


def test_the_dry_run_fails_naming_what_is_missing(tmp_path: Path) -> None:
    """An interpreter without Forge installed: the first missing module is named."""
    bare = shutil.which("python3", path="/usr/bin:/bin")
    assert bare is not None
    done = _dry_run(bare)
    assert done.returncode != 0
    assert "FAILED: dry run: module" in done.stderr
