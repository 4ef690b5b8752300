"""`make test`: every test folder in its own pytest process, a few at a time.

Much of the suite waits rather than computes (service processes starting, Temporal workflows,
canary windows, spawned training ranks importing torch), so folders run side by side finish in
far less wall time than one pytest process running them in turn. Each folder is one pytest
process: its session fixtures (broker, Temporal dev server) are its own, every server binds a free
port and every database is named at random, so the processes share nothing but the machine.

Each unit's CPU seconds (its processes and the descendants they reaped) are printed beside its
time. Units inherit the environment (``OMP_NUM_THREADS=1 python scripts/run_tests.py`` caps the
thread pools of torch, vLLM and the services they spawn).

Usage: python scripts/run_tests.py [-j N] [PATH ...] [-- PYTEST ARGS]

The paths (default: libs services tests) are split into units: each ``<path>/*/tests`` folder
under libs/ and services/, each sub-folder of tests/ and tests/ itself without them. Units start
longest first (:data:`EXPECTED_S`); each one's output is printed whole when it ends. The exit
status is 0 when every unit passed, else the first failing unit's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Seconds of each unit in a quiet run here (three at a time): only their order matters (the
#: longest start first, so no long unit is left to run alone at the end).
EXPECTED_S = {
    "services/orchestrator/tests [4/4]": 436,
    "services/eval/tests": 289,
    "libs/training/tests [2/2]": 211,
    "services/inference_gateway/tests": 179,
    "tests": 172,
    "services/orchestrator/tests [2/4]": 172,
    "tests/security": 170,
    "services/trainer_agent/tests": 154,
    "services/orchestrator/tests [1/4]": 149,
    "libs/training/tests [1/2]": 146,
    "services/orchestrator/tests [3/4]": 141,
    "tests/fuzz": 84,
    "libs/kit/tests": 76,
    "services/model_server/tests": 63,
    "services/retriever/tests": 52,
    "services/preference_feedback/tests": 41,
}


#: Folders long enough to be split: each listed group of modules is a unit of its own, and the
#: folder's other modules one more. (The RLHF rounds and the synthetic runs train for minutes;
#: deployments start model servers and vLLM, a minute or more each; the training exports' vLLM
#: tests train every recipe a step and load each export in vLLM.)
SPLIT = {
    "libs/training/tests": [["test_training_vllm_export.py", "test_training_vllm_recipes.py"]],
    "services/orchestrator/tests": [
        ["test_orchestrator_rlhf.py", "test_orchestrator_rlhf_online.py"],
        [
            "test_orchestrator_synthetic.py",
            "test_orchestrator_sweep_cli.py",
            "test_orchestrator_sweep_jobs.py",
        ],
        ["test_orchestrator_deployments.py", "test_orchestrator_vllm_deployment.py"],
    ],
}


def _folder(folder: str) -> list[tuple[str, list[str]]]:
    """The units of one package's tests folder."""
    groups = SPLIT.get(folder)
    if not groups:
        return [(folder, [folder])]
    named = [m for group in groups for m in group]
    missing = [m for m in named if not (ROOT / folder / m).is_file()]
    if missing:
        raise SystemExit(f"run_tests.py: SPLIT names modules that are not in {folder}: {missing}")
    rest = sorted(p.name for p in (ROOT / folder).glob("test_*.py") if p.name not in named)
    return [
        (f"{folder} [{i + 1}/{len(groups) + 1}]", [f"{folder}/{m}" for m in group])
        for i, group in enumerate([*groups, rest])
    ]


def units(paths: list[str]) -> list[tuple[str, list[str]]]:
    """(name, pytest arguments) of each unit under ``paths``, longest expected first."""
    out: list[tuple[str, list[str]]] = []
    for path in paths:
        folder = ROOT / path
        if path.rstrip("/") in SPLIT:  # one package's tests folder, named on its own
            out += _folder(path.rstrip("/"))
            continue
        nested = sorted(p for p in folder.glob("*/tests") if p.is_dir())
        if nested:  # libs/, services/: one unit per package's tests
            out += [u for p in nested for u in _folder(str(p.relative_to(ROOT)))]
            continue
        subfolders = (
            sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith((".", "__")))
            if folder.is_dir()
            else []
        )
        if subfolders:  # tests/: each sub-folder, then the folder's own modules
            out += [(str(p.relative_to(ROOT)), [str(p.relative_to(ROOT))]) for p in subfolders]
            ignore = [f"--ignore={p.relative_to(ROOT)}" for p in subfolders]
            out.append((path, [path, *ignore]))
        else:
            out.append((path, [path]))
    return sorted(out, key=lambda unit: -EXPECTED_S.get(unit[0], 0))


def main(argv: list[str]) -> int:
    own, pytest_args = argv, []
    if "--" in argv:
        own, pytest_args = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-j", "--jobs", type=int, default=int(os.environ.get("FORGE_TEST_JOBS", "3")))
    parser.add_argument("paths", nargs="*", default=["libs", "services", "tests"])
    args = parser.parse_args(own)
    todo = units(args.paths)
    lock = threading.Lock()
    results: dict[str, tuple[int, float, float]] = {}
    started = time.monotonic()

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                name, unit_args = todo.pop(0)
            begin = time.monotonic()
            with tempfile.TemporaryFile(mode="w+") as log:
                command = [sys.executable, "-m", "pytest", *pytest_args, *unit_args]
                process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
                _, status, usage = os.wait4(process.pid, 0)
                process.returncode = rc = os.waitstatus_to_exitcode(status)
                log.seek(0)
                output = log.read()
            elapsed, cpu = time.monotonic() - begin, usage.ru_utime + usage.ru_stime
            with lock:
                results[name] = (rc, elapsed, cpu)
                print(
                    f"===== {name}: exit {rc} in {elapsed:.0f} s ({cpu:.0f} CPU s) =====\n{output}",
                    flush=True,
                )

    threads = [threading.Thread(target=worker) for _ in range(max(1, args.jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    cpu_s = sum(cpu for _, _, cpu in results.values())
    print(
        f"===== {len(results)} units in {time.monotonic() - started:.0f} s ({args.jobs} at a time, "
        f"{cpu_s:.0f} CPU s) ====="
    )
    failed = 0
    for name, (rc, elapsed, cpu) in sorted(results.items(), key=lambda item: -item[1][1]):
        print(f"{'FAILED' if rc not in (0, 5) else 'ok':>6}  {elapsed:5.0f} s  {cpu:5.0f} CPU s  {name}")
        if rc not in (0, 5) and not failed:
            failed = rc
    return failed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
