"""``python -m load soak --minutes M``: mixed traffic for a set time, memory and errors watched.

The scheduler API, RAG (retriever + reranker) and inference (gateway + model server) scenarios
run together, each with its own clients, for ``M`` minutes. Every ``--sample-s`` seconds the
resident memory of every service process (and its children) is read from ``/proc``; outcomes are
counted per one-minute window. Checked at the end:

1. **memory flat after warm-up**: for each service, the mean of the last three samples is at most
   ``1 + --rss-growth`` (default 10%) times the mean of the three samples after warm-up (the
   first ``--warmup`` of the run, default 25%);
2. **no error-rate growth**: the error rate of the second half of the windows is at most the first
   half's plus 0.1 percentage point, and the whole run's is under 1%;
3. the scenarios' own audits (nothing lost or duplicated, nothing left running).

Writes ``OUT/soak.json`` and ``OUT/soak.png`` (memory per service over time, error rate per window)
and exits 1 when a check fails.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from . import scenarios
from .measure import Tally, rss_mib

ERROR_GROWTH = 0.001
MAX_ERROR_RATE = 0.01


async def _sample(
    procs: dict[str, Any], every_s: float, until: float, samples: dict[str, list[tuple[float, float]]]
) -> None:
    start = time.monotonic()
    while True:
        now = time.monotonic()
        for name, proc in procs.items():
            if proc.pid:
                samples.setdefault(name, []).append((now - start, rss_mib(proc.pid)))
        if now >= until:
            return
        await asyncio.sleep(min(every_s, max(0.0, until - now)))


async def _soak(
    parts: list[scenarios.Scenario], seconds: float, every_s: float
) -> tuple[dict[str, Tally], dict[str, list[tuple[float, float]]]]:
    tallies = {p.name: Tally(window_s=60.0) for p in parts}
    samples: dict[str, list[tuple[float, float]]] = {}
    procs = {name: proc for p in parts for name, proc in p.processes().items()}
    until = time.monotonic() + seconds
    await asyncio.gather(
        _sample(procs, every_s, until, samples), *(p.drive(seconds, tallies[p.name]) for p in parts)
    )
    return tallies, samples


def memory_growth(series: list[tuple[float, float]], warmup_s: float) -> float | None:
    """Relative growth of resident memory from just after warm-up to the end."""
    after = [rss for t, rss in series if t >= warmup_s]
    if len(after) < 6:
        return None
    base = sum(after[:3]) / 3
    end = sum(after[-3:]) / 3
    return end / base - 1 if base else None


def soak(out: Path, args: Any) -> int:
    out.mkdir(parents=True, exist_ok=True)
    seconds = args.minutes * 60
    parts: list[scenarios.Scenario] = [
        scenarios.SchedulerApi(clients=2, cancel_every=1),
        scenarios.Rag(dataset=args.dataset, documents=args.documents, clients=2),
        scenarios.Inference(clients=4),
    ]
    started: list[scenarios.Scenario] = []
    try:
        for part in parts:
            print(f"starting {part.name}", flush=True)
            part.start(out / part.name)
            started.append(part)
        print(f"soaking for {args.minutes} min", flush=True)
        tallies, samples = asyncio.run(_soak(parts, seconds, args.sample_s))
        audits = {p.name: asyncio.run(p.audit()) for p in parts}
    finally:
        for part in started:
            part.stop()
    warmup_s = seconds * args.warmup
    result: dict[str, Any] = {"minutes": args.minutes, "services": {}, "scenarios": {}, "checks": {}}
    ok = True
    for name, series in sorted(samples.items()):
        growth = memory_growth(series, warmup_s)
        flat = growth is not None and growth <= args.rss_growth
        ok &= flat
        result["services"][name] = {
            "rss_mib_first": round(series[0][1], 1),
            "rss_mib_last": round(series[-1][1], 1),
            "rss_growth_after_warmup": None if growth is None else round(growth, 4),
            "flat": flat,
        }
    for name, tally in tallies.items():
        rates = tally.error_rates()
        half = len(rates) // 2
        first = sum(rates[:half]) / max(1, half)
        second = sum(rates[half:]) / max(1, len(rates) - half)
        summary = tally.summary()
        steady = second <= first + ERROR_GROWTH and float(summary["error_rate"]) < MAX_ERROR_RATE  # type: ignore[arg-type]
        audit = audits[name]
        clean = (
            audit.get("lost", 0) == 0
            and audit.get("duplicated", 0) == 0
            and not audit.get("requests_left_on_server", 0)
        )
        ok &= steady and clean
        result["scenarios"][name] = {
            **summary,
            "error_rate_per_window": rates,
            "steady": steady,
            "audit": audit,
            "clean": clean,
        }
    result["pass"] = ok
    (out / "soak.json").write_text(json.dumps(result, indent=2, sort_keys=True, default=str))
    _plot(samples, tallies, out / "soak.png")
    for name, row in result["services"].items():
        print(
            f"   {'ok  ' if row['flat'] else 'MISS'} {name:<18} rss {row['rss_mib_first']:.0f} -> {row['rss_mib_last']:.0f} MiB, growth after warm-up {row['rss_growth_after_warmup']}"
        )
    for name, row in result["scenarios"].items():
        print(
            f"   {'ok  ' if row['steady'] and row['clean'] else 'MISS'} {name:<18} {row['completed']} ok, {row['failed']} failed, audit {row['audit']}"
        )
    print(f"soak: {out / 'soak.json'} — {'pass' if ok else 'FAIL'}")
    return 0 if ok else 1


def _plot(samples: dict[str, list[tuple[float, float]]], tallies: dict[str, Tally], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, err) = plt.subplots(2, 1, figsize=(9, 7))
    for name, series in sorted(samples.items()):
        mem.plot([t / 60 for t, _ in series], [r for _, r in series], label=name)
    mem.set_xlabel("minutes")
    mem.set_ylabel("resident MiB")
    mem.legend(fontsize="small")
    for name, tally in tallies.items():
        err.plot(
            range(len(tally.error_rates())), [100 * r for r in tally.error_rates()], marker="o", label=name
        )
    err.set_xlabel("minute")
    err.set_ylabel("error rate %")
    err.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
