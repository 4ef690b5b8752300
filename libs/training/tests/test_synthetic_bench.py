"""The synthetic benchmark's pieces: subsets cut to an equal token budget, and the command wired
into ``forge_training.bench`` (runnable as ``python -m forge_training.bench synthetic``)."""

from __future__ import annotations

import subprocess
import sys

from forge_training.synthetic.bench import default_tasks_dir, equal_token_rows


def test_equal_token_rows_fill_the_budget_by_repeating() -> None:
    rows = [{"chosen": str(i), "rejected": "x"} for i in range(3)]
    out, total = equal_token_rows(rows, [10, 20, 30], 125, seed=1)
    assert total <= 125 and total > 125 - 30
    assert total == sum({"0": 10, "1": 20, "2": 30}[r["chosen"]] for r in out)
    assert len(out) > len(rows)  # a small subset is repeated
    again, _ = equal_token_rows(rows, [10, 20, 30], 125, seed=1)
    assert again == out
    assert equal_token_rows([], [], 100, seed=0) == ([], 0)
    big, tokens = equal_token_rows(rows, [10, 20, 30], 5, seed=0)
    assert big == [] and tokens == 0


def test_the_eval_tasks_are_found_in_this_checkout() -> None:
    assert (default_tasks_dir() / "gsm8k.yaml").is_file()


def test_bench_module_runs_the_synthetic_command() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "forge_training.bench", "synthetic", "--help"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "--out" in out.stdout and "--quick" in out.stdout
