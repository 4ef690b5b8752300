"""The synthetic benchmark's pieces: subsets cut to an equal token budget, and the command wired
into ``forge_training.bench`` (runnable as ``python -m forge_training.bench synthetic``)."""

from __future__ import annotations

import subprocess
import sys

from forge_kit.stats import item_means
from forge_training.synthetic.bench import (
    _accuracy,
    _band_vs_unfiltered,
    equal_token_rows,
)
from forge_training.synthetic.dedup import default_tasks_dir


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
    assert all(o in out.stdout for o in ("--out", "--quick", "--sft-seeds", "--problems"))


def test_scores_over_fine_tuning_seeds_are_averaged_per_problem() -> None:
    runs = [[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]
    means = item_means(runs)
    assert means == [1.0, 1 / 3, 1 / 3, 0.0]
    one = _accuracy(runs[0])
    assert one["interval"] == "wilson" and one["accuracy"] == 0.5 and one["n"] == 4
    avg = _accuracy(means * 50, seed=1)
    assert avg["interval"] == "bootstrap" and abs(avg["accuracy"] - 5 / 12) < 1e-12
    assert avg["ci95"][0] < avg["accuracy"] < avg["ci95"][1]
    # averaged scores are not 0/1: the paired comparison falls back from McNemar to sign flips
    paired = _band_vs_unfiltered({"unfiltered": [0.0] * 200, "band": means * 50}, seed=0)
    assert paired["test"] == "sign-flip" and paired["ci95"][0] > 0
    binary = _band_vs_unfiltered({"unfiltered": [0.0] * 4, "band": runs[0]}, seed=0)
    assert binary["test"] == "mcnemar"
