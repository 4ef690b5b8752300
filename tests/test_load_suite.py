"""The load suite's own logic (thresholds, figure lookup, memory growth) and one real, short
scenario: the scheduler API driven for a few seconds, with its end-to-end count."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from load.suite import runner, scenarios  # noqa: E402
from load.suite.measure import Tally, rss_mib  # noqa: E402
from load.suite.soak import memory_growth  # noqa: E402


def test_every_threshold_names_a_known_scenario_and_one_bound() -> None:
    checks = runner.load_checks()
    assert checks
    for check in checks:
        assert check.scenario in runner.SCENARIOS, check
        assert check.bound in ("max", "min")


def test_a_threshold_with_two_bounds_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "t.toml"
    bad.write_text("[rag]\nfailed = { max = 0, min = 0 }\n")
    with pytest.raises(SystemExit, match="exactly one of max or min"):
        runner.load_checks(bad)


def test_lookup_and_verdict() -> None:
    result = {"ops": {"search": {"p95_ms": 40.0}}, "lost": 0, "ok": True}
    assert runner.lookup(result, "ops.search.p95_ms") == 40.0
    assert runner.lookup(result, "ops.rerank.p95_ms") is None
    assert runner.lookup(result, "ok") is None  # a flag is not a figure
    at_most = runner.Check("rag", "ops.search.p95_ms", "max", 50, None, "")
    assert at_most.verdict(40.0) and not at_most.verdict(60.0) and not at_most.verdict(None)
    at_least = runner.Check("rag", "throughput_per_s", "min", 10, None, "")
    assert at_least.verdict(10.0) and not at_least.verdict(float("nan"))


def test_memory_growth_after_warmup() -> None:
    flat = [(t, 100.0 + (50 if t < 10 else 0)) for t in range(0, 60, 5)]  # warm-up spike, then flat
    assert memory_growth(flat, warmup_s=10) == pytest.approx(0.0)
    leak = [(t, 100.0 + t) for t in range(0, 60, 5)]
    growth = memory_growth(leak, warmup_s=10)
    assert growth is not None and growth > 0.3
    assert memory_growth(leak[:4], warmup_s=0) is None  # too few samples to judge


def test_tally_counts_errors_per_window() -> None:
    tally = Tally(window_s=1000)
    tally.record("op", 0.01)
    tally.record("op", 0.0, "UNAVAILABLE")
    assert tally.completed == 1 and tally.failed == 1
    assert tally.error_rates() == [0.5]
    assert tally.summary()["errors"] == {"op: UNAVAILABLE": 1}


def test_rss_of_this_process_is_read_from_proc() -> None:
    import os

    assert rss_mib(os.getpid()) > 10
    assert rss_mib(2**22 + 12345) == 0


@pytest.mark.integration
def test_scheduler_api_scenario_counts_every_job_end_to_end(tmp_path: Path) -> None:
    result = runner.drive(scenarios.SchedulerApi(clients=2), tmp_path, seconds=3.0)
    assert result["failed"] == 0, result["errors"]
    assert result["jobs_submitted"] > 0
    assert result["jobs_listed"] == result["jobs_submitted"]
    assert result["lost"] == 0 and result["duplicated"] == 0


def test_an_unknown_scenario_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="unknown nope"):
        runner.run(["nope"], tmp_path, SimpleNamespace())


def test_hnsw_bench_measures_recall_against_exact_search(tmp_path: Path) -> None:
    """A small run of the HNSW curve: the full scan finds exactly numpy's top 10; on isotropic
    vectors (past the 1 MB indexing threshold, so the graph is built) a beam of 4 misses some of
    them and a beam of 128 recalls more."""
    import json

    from load.retrieval import bench_hnsw

    out = tmp_path / "hnsw"
    args = ["--out", str(out), "--vectors", "3000", "--queries", "40", "--dim", "128", "--ef", "4,128"]
    args += ["--data", "gaussian"]
    assert bench_hnsw.main(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["exact"]["recall@10"] == 1.0
    narrow, wide = summary["curve"]
    assert 0 < narrow["recall@10"] < wide["recall@10"] <= 1.0
    assert summary["build"]["optimize_s"] >= 0 and summary["vectors"] == 3000
    with pytest.raises(SystemExit):
        bench_hnsw.main(["--out", str(out), "--vectors", "0"])
