"""``python -m load run``: every scenario once, its figures checked against ``load/thresholds.toml``.

Two kinds of scenario:

- **driven** (``scenarios.py``): the suite starts the services, drives them with a closed loop of
  clients for ``--seconds``, and counts what the services hold afterwards;
- **benchmarks** that already exist as scripts (the scheduler's cycle, preference ingest across a
  broker restart, the gateway's overhead): run as subprocesses with bounded sizes, their JSON read
  back.

Each threshold names the figure it checks (a dotted path into the scenario's result), a bound
(``max`` or ``min``), and where the bound came from (``baseline``: the figure measured when the
bound was set, ``measured_on``: how). The report prints measured / bound side by side, writes
``OUT/report.json`` and ``OUT/report.png``, and exits 1 when a bound is missed or a scenario fails.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import scenarios
from .measure import Tally
from .services import REPO

THRESHOLDS = REPO / "load" / "thresholds.toml"


@dataclass(frozen=True)
class Check:
    scenario: str
    figure: str
    bound: str  # "max" or "min"
    limit: float
    baseline: float | None
    measured_on: str

    def verdict(self, value: float | None) -> bool:
        if value is None or math.isnan(value):
            return False
        return value <= self.limit if self.bound == "max" else value >= self.limit


def load_checks(path: Path = THRESHOLDS) -> list[Check]:
    """The thresholds file; a malformed entry stops the run naming it."""
    data = tomllib.loads(path.read_text())
    checks = []
    for scenario, figures in data.items():
        for figure, spec in figures.items():
            bounds = [b for b in ("max", "min") if b in spec]
            if len(bounds) != 1:
                raise SystemExit(f"{path}: [{scenario}] {figure}: give exactly one of max or min")
            checks.append(
                Check(
                    scenario=scenario,
                    figure=figure,
                    bound=bounds[0],
                    limit=float(spec[bounds[0]]),
                    baseline=float(spec["baseline"]) if "baseline" in spec else None,
                    measured_on=str(spec.get("measured_on", "")),
                )
            )
    return checks


def lookup(result: dict[str, Any], dotted: str) -> float | None:
    node: Any = result
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return float(node) if isinstance(node, (int, float)) and not isinstance(node, bool) else None


def drive(scenario: scenarios.Scenario, work: Path, seconds: float) -> dict[str, Any]:
    """Start, drive for ``seconds``, audit, stop: the scenario's result."""
    scenario.start(work)
    try:
        tally = Tally(window_s=max(1.0, seconds))
        started = time.monotonic()
        asyncio.run(scenario.drive(seconds, tally))
        elapsed = time.monotonic() - started
        audit = asyncio.run(scenario.audit())
    finally:
        scenario.stop()
    return {**tally.summary(), "throughput_per_s": tally.completed / elapsed, **audit}


def script(argv: list[str], result_file: Path, timeout_s: float) -> dict[str, Any]:
    """Run a benchmark script; its JSON result (it may exit 1 on its own target: the suite's
    thresholds decide here)."""
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    if not result_file.exists():
        raise RuntimeError(
            f"{' '.join(argv)} wrote no {result_file.name} (exit {done.returncode}):\n{done.stderr[-2000:]}"
        )
    return dict(json.loads(result_file.read_text()))


def forge_bin() -> str:
    return str(Path(sys.executable).with_name("forge"))


def run_scheduler_cycle(out: Path, args: Any) -> dict[str, Any]:
    folder = out / "scheduler_cycle"
    argv = [
        forge_bin(),
        "sim",
        "cycle",
        "--pending",
        "10000",
        "--nodes",
        "1000",
        "--gpus-per-node",
        "8",
        "--out",
        str(folder),
    ]
    return script(argv, folder / "summary.json", 1200)


def run_feedback_ingest(out: Path, args: Any) -> dict[str, Any]:
    result = out / "feedback_ingest" / "result.json"
    result.parent.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable,
        "load/feedback/bench_ingest.py",
        "--preferences",
        str(args.preferences),
        "--out",
        str(result),
    ]
    return script(argv, result, 1200)


def run_gateway_overhead(out: Path, args: Any) -> dict[str, Any]:
    folder = out / "gateway_overhead"
    argv = [
        sys.executable, "load/inference/bench_gateway.py", "--out", str(folder), "--scenarios", "overhead",
        "--overhead-prompts", "100", "--rounds", "1",
    ]  # fmt: skip
    return script(argv, folder / "gateway_bench.json", 1200)


def _driven(factory: Callable[[Any], scenarios.Scenario]) -> Callable[[Path, Any], dict[str, Any]]:
    def run(out: Path, args: Any) -> dict[str, Any]:
        scenario = factory(args)
        return drive(scenario, out / scenario.name, args.seconds)

    return run


SCENARIOS: dict[str, Callable[[Path, Any], dict[str, Any]]] = {
    "scheduler_api": _driven(lambda a: scenarios.SchedulerApi()),
    "rag": _driven(lambda a: scenarios.Rag(dataset=a.dataset, documents=a.documents)),
    "inference": _driven(lambda a: scenarios.Inference()),
    "feedback_ingest": run_feedback_ingest,
    "scheduler_cycle": run_scheduler_cycle,
    "gateway_overhead": run_gateway_overhead,
}


def run(names: list[str], out: Path, args: Any) -> int:
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise SystemExit(f"--scenarios: unknown {', '.join(unknown)} (known: {', '.join(SCENARIOS)})")
    checks = load_checks()
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"scenarios": {}, "checks": []}
    failed = False
    for name in names:
        print(f"== {name}", flush=True)
        started = time.monotonic()
        try:
            result = SCENARIOS[name](out, args)
        except Exception as exc:  # noqa: BLE001 — a scenario that cannot run fails the suite, with the reason
            result = {"error": f"{type(exc).__name__}: {exc}"}
            failed = True
        result["wall_s"] = round(time.monotonic() - started, 1)
        report["scenarios"][name] = result
        (out / f"{name}.json").write_text(json.dumps(result, indent=2, sort_keys=True, default=str))
        for check in (c for c in checks if c.scenario == name):
            value = lookup(result, check.figure)
            ok = check.verdict(value)
            failed |= not ok
            row = {
                "scenario": name,
                "figure": check.figure,
                "value": value,
                check.bound: check.limit,
                "baseline": check.baseline,
                "ratio_to_bound": (value / check.limit) if value is not None and check.limit else None,
                "pass": ok,
            }
            report["checks"].append(row)
            bound = f"{'<=' if check.bound == 'max' else '>='} {check.limit:g}"
            shown = "missing" if value is None else f"{value:.4g}"
            base = "" if check.baseline is None else f"  (baseline {check.baseline:g})"
            print(f"   {'ok  ' if ok else 'MISS'} {check.figure:<28} {shown:>10} {bound}{base}", flush=True)
        if "error" in result:
            print(f"   FAILED: {result['error']}", flush=True)
    report["pass"] = not failed
    (out / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True, default=str))
    plot(report, out / "report.png")
    print(f"report: {out / 'report.json'} — {'pass' if not failed else 'FAIL'}")
    return 0 if not failed else 1


def plot(report: dict[str, Any], path: Path) -> None:
    """One bar per check: measured / bound (below 1 is inside a max bound, above 1 a min bound)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["checks"] if r["ratio_to_bound"] is not None]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(rows) + 1.5))
    labels = [f"{r['scenario']}: {r['figure']}" for r in rows]
    ax.barh(
        labels,
        [r["ratio_to_bound"] for r in rows],
        color=["tab:green" if r["pass"] else "tab:red" for r in rows],
    )
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xlabel("measured / threshold")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
