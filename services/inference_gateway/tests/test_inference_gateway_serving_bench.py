"""``forge bench serving``'s CPU accounting: a server's CPU seconds include its children's."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from forge_inference_gateway.bench.serving import tree_cpu_s

BUSY_THEN_WAIT = (
    "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass\ntime.sleep(30)"
)


def test_tree_cpu_counts_live_children_and_is_zero_for_no_process() -> None:
    own = tree_cpu_s(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", BUSY_THEN_WAIT])
    try:
        deadline = time.monotonic() + 60
        while tree_cpu_s(child.pid) < 0.5 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert tree_cpu_s(child.pid) >= 0.5
        assert tree_cpu_s(os.getpid()) >= own + 0.5  # the child's seconds count for its parent
    finally:
        child.kill()
        child.wait()
    assert tree_cpu_s(child.pid) == 0.0  # gone
