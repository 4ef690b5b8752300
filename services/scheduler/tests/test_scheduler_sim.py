"""Simulator: trace validation, replay behaviour on small traces, the CLI's benchmark contract."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from forge_scheduler.gcpause import collector_paused
from forge_scheduler.sim.cli import app
from forge_scheduler.sim.cycle import CycleBench, run_cycle_bench
from forge_scheduler.sim.pack import PackNode, Pod, run_pack
from forge_scheduler.sim.replay import SimSettings, pooled_sjf_avg_jct, replay
from forge_scheduler.sim.trace import TraceError, TraceJob, load_trace

runner = CliRunner()


def _csv(path: Path, rows: list[str], header: str = "submit_time,duration_s,num_gpus,team") -> Path:
    path.write_text("\n".join([header, *rows]) + "\n")
    return path


@pytest.mark.parametrize(
    ("rows", "header", "message"),
    [
        (["0,10,1,a"], "submit_time,duration_s,team", "missing column(s) num_gpus"),
        (["0,10,0,a"], None, "row 2: num_gpus: must be positive"),
        (["0,-5,1,a"], None, "row 2: duration_s: must be positive"),
        (["yesterday,5,1,a"], None, "row 2: submit_time: neither seconds nor an ISO time"),
        (["0,5,1,"], None, "row 2: team: empty"),
        (["0,5,1.5,a"], None, "row 2: num_gpus: must be a whole number"),
    ],
)
def test_trace_errors_name_row_and_field(
    tmp_path: Path, rows: list[str], header: str | None, message: str
) -> None:
    path = _csv(tmp_path / "t.csv", rows, header or "submit_time,duration_s,num_gpus,team")
    with pytest.raises(TraceError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_trace(path)


def test_iso_and_philly_times_are_shifted_to_zero_and_sorted(tmp_path: Path) -> None:
    path = _csv(
        tmp_path / "p.csv",
        ["2017-10-09 07:01:55,66.0,1,66.0,vc1", "2017-10-09 06:01:55,30.0,2,60.0,vc2"],
        "timestamp,duration,num_gpus,gpu_time,cluster",
    )
    jobs = load_trace(path, "philly")
    assert [(j.submit_time, j.team, j.num_gpus) for j in jobs] == [(0.0, "vc2", 2), (3600.0, "vc1", 1)]


def _short_behind_long() -> list[TraceJob]:
    """One 8-GPU job of 10 h holds the whole 8-GPU cluster; twenty 10-minute jobs arrive after."""
    jobs = [TraceJob("long", 0.0, 36_000.0, 8, "a")]
    jobs += [TraceJob(f"s{i:02d}", 60.0 + i, 600.0, 1, "b") for i in range(20)]
    return jobs


def test_forge_lets_short_jobs_pass_a_long_one_without_knowing_durations() -> None:
    settings = SimSettings(gpus=8, gpus_per_node=8, min_runtime_s=600.0)
    forge = replay(_short_behind_long(), "forge", settings)
    fifo = replay(_short_behind_long(), "fifo", settings)
    assert len(forge.jct) == len(fifo.jct) == 21
    assert forge.preemptions >= 1
    mean = lambda r: sum(r.jct.values()) / len(r.jct)  # noqa: E731
    assert mean(forge) < 0.3 * mean(fifo)
    assert forge.jct["long"] >= 36_000.0  # it still finishes, with its work kept


def test_replay_is_deterministic() -> None:
    settings = SimSettings(gpus=16, gpus_per_node=8)
    trace = [TraceJob(f"j{i}", i * 30.0, 300.0 + (i * 37) % 900, 1 + i % 8, "ab"[i % 2]) for i in range(60)]
    first, second = replay(trace, "forge", settings), replay(trace, "forge", settings)
    assert first.jct == second.jct and first.preemptions == second.preemptions


def test_arrivals_inside_the_cycle_interval_wait_for_the_next_cycle() -> None:
    """b arrives 10 s after the cycle that started a: with a 60 s interval it starts at 60 s (a
    cycle at most once a minute), with 0 at its own arrival; a cluster of 8 GPUs has room for both."""
    trace = [TraceJob("a", 0.0, 1000.0, 1, "t"), TraceJob("b", 10.0, 1000.0, 1, "t")]
    minute = replay(trace, "fifo", SimSettings(gpus=8, cycle_interval_s=60.0))
    every = replay(trace, "fifo", SimSettings(gpus=8, cycle_interval_s=0.0))
    assert minute.queue == {"a": 0.0, "b": 50.0}
    assert every.queue == {"a": 0.0, "b": 0.0}
    assert minute.cycles == every.cycles == 2


def test_pooled_relaxation_is_sjf_on_one_pool() -> None:
    trace = [TraceJob("a", 0.0, 100.0, 1, "t"), TraceJob("b", 0.0, 10.0, 1, "t")]
    assert pooled_sjf_avg_jct(trace, 1) == pytest.approx((10.0 + 110.0) / 2)


def test_cli_replay_writes_the_contract(tmp_path: Path) -> None:
    rows = [f"{i * 40},{200 + (i * 53) % 700},{[1, 2, 4, 8][i % 4]},{'xy'[i % 2]}" for i in range(40)]
    trace = _csv(tmp_path / "t.csv", rows)
    out = tmp_path / "out"
    result = runner.invoke(
        app, ["replay", "--trace", str(trace), "--gpus", "16", "--out", str(out), "--workers", "1"]
    )
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["policies"]) == {"forge", "fifo", "fifo-backfill", "multifactor"}
    for figures in summary["policies"].values():
        queue_keys = {"p95_queue_s", "p99_queue_s", "max_queue_s", "p99_wait_s", "max_wait_s"}
        assert set(figures) == {
            "avg_jct_s",
            *queue_keys,
            "queue_by_team",
            "utilization",
            "makespan_s",
            "jain_index",
            "fragmentation",
        }
        assert 0 < figures["utilization"] <= 1
        assert figures["p95_queue_s"] <= figures["p99_queue_s"] <= figures["max_queue_s"]
        assert figures["max_queue_s"] <= figures["max_wait_s"]
        assert set(figures["queue_by_team"]) == {"x", "y"}
        for team in figures["queue_by_team"].values():
            assert set(team) == queue_keys
            assert team["max_queue_s"] <= figures["max_queue_s"]
        assert max(t["max_wait_s"] for t in figures["queue_by_team"].values()) == figures["max_wait_s"]
    assert set(summary["lower_bounds"]) == {"mean_duration_s", "capacity_relaxation_s"}
    assert (out / "utilization.png").stat().st_size > 0
    assert (out / "queue_by_team_forge.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpus", "12"], "not a multiple of --gpus-per-node"),
        (["--gpus", "16", "--policies", "forge,lottery"], "policies: unknown"),
        (["--gpus", "4", "--gpus-per-node", "4"], "num_gpus: job"),
        (["--gpus", "16", "--cycle-interval", "-1"], "cycle-interval: must be zero or"),
    ],
)
def test_cli_replay_refuses_bad_input_and_writes_nothing(
    tmp_path: Path, args: list[str], message: str
) -> None:
    trace = _csv(tmp_path / "t.csv", ["0,10,8,a"])
    out = tmp_path / "out"
    result = runner.invoke(app, ["replay", "--trace", str(trace), "--out", str(out), *args])
    assert result.exit_code == 2
    assert message in result.output
    assert not out.exists()


def test_cli_cycle_writes_percentiles(tmp_path: Path) -> None:
    result = runner.invoke(
        app, ["cycle", "--pending", "200", "--nodes", "20", "--cycles", "3", "--out", str(tmp_path / "c")]
    )
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "c" / "summary.json").read_text())
    assert 0 < summary["cycle_ms"]["p50"] <= summary["cycle_ms"]["p99"]


def test_cycles_run_with_the_collector_paused_and_restore_it_after(tmp_path: Path) -> None:
    seen: list[bool] = []

    def clock() -> float:
        seen.append(gc.isenabled())
        return 0.0

    assert gc.isenabled()
    run_cycle_bench(CycleBench(pending=50, nodes=4, cycles=2), clock=clock)
    assert seen == [False] * 4, "the timed cycle ran with the cyclic collector on"
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused(), collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled(), "a collector that was off before stays off"
    finally:
        gc.enable()
    with collector_paused():
        with collector_paused():
            pass
        assert not gc.isenabled(), "the inner pause ended the outer one"
    assert gc.isenabled()


def test_pack_reports_allocation_at_first_failure() -> None:
    nodes = [PackNode("a", 64000, 262144, 2, "T4"), PackNode("b", 64000, 262144, 1, "T4")]
    pods = [Pod("half", 1000, 1024, 1, 500, ()), Pod("two", 1000, 1024, 2, 1000, ())]
    figures = run_pack(nodes, pods, "forge", seed=1)
    assert 0 < figures["allocation_rate_at_first_failure"] <= 100
    assert set(figures) >= {"allocation_rate_at_first_failure", "fragmentation_at_full_arrival"}


def test_forge_packing_keeps_cpu_for_the_gpus_that_need_it() -> None:
    """Two CPU-light and two CPU-heavy one-GPU pods fill both nodes only if the heavy ones get
    the CPU-rich node. GPU best fit puts a light pod there when a heavy one came first and strands
    the lean node's GPUs; forge does not, in any arrival order."""
    nodes = [PackNode("lean", 16000, 65536, 2, "T4"), PackNode("rich", 96000, 262144, 2, "T4")]
    pods = [Pod(f"light{i}", 8000, 1024, 1, 1000, ()) for i in range(2)]
    pods += [Pod(f"heavy{i}", 40000, 1024, 1, 1000, ()) for i in range(2)]
    seeds = range(12)
    forge = [run_pack(nodes, pods, "forge", s)["allocation_rate_at_first_failure"] for s in seeds]
    bestfit = [run_pack(nodes, pods, "bestfit", s)["allocation_rate_at_first_failure"] for s in seeds]
    assert forge == [100.0] * len(seeds)
    assert min(bestfit) == 75.0
