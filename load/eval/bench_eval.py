"""Eval benchmarks with thresholds (see README.md for where each number comes from).

    python load/eval/bench_eval.py bootstrap
        paired bootstrap, 10,000 resamples over 10,000 paired 0/1 examples (and over continuous
        scores); threshold: under 1 s for the 0/1 case.
    python load/eval/bench_eval.py throughput --endpoint URL --model NAME [--task mmlu] [--limit 200]
        the same spec sequentially (batch 1, one request in flight) and concurrently (batch 16,
        8 in flight), cache off; threshold: at least 5x faster with identical samples and summary.
    python load/eval/bench_eval.py rerun --endpoint URL --model NAME [--task mmlu] [--limit 200]
        a run and a re-run of the unchanged spec through one cache; threshold: zero model calls on
        the re-run and an identical summary.

Each prints one JSON line with the figures and ``"pass": true|false`` and exits 1 on a miss.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from forge_eval import stats
from forge_eval.backend import OpenAIBackend, ResponseCache
from forge_eval.harness import TaskRun, run_task
from forge_eval.spec import resolve_data_path
from forge_eval.tasks import DataRoots, load_task

BOOTSTRAP_LIMIT_S = 1.0
SPEEDUP_TARGET = 5.0


def bench_bootstrap() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    baseline = (rng.random(10_000) < 0.62).astype(float)
    candidate = np.where(rng.random(10_000) < 0.1, 1 - baseline, baseline)
    started = time.perf_counter()
    binary = stats.paired_compare(baseline.tolist(), candidate.tolist(), resamples=10_000, seed=1)
    binary_s = time.perf_counter() - started
    started = time.perf_counter()
    stats.paired_compare(rng.random(10_000).tolist(), rng.random(10_000).tolist(), resamples=10_000, seed=1)
    continuous_s = time.perf_counter() - started
    return {
        "bench": "paired_bootstrap_10k_x_10k",
        "binary_s": round(binary_s, 4),
        "continuous_s": round(continuous_s, 4),
        "delta": binary.delta,
        "ci": [binary.ci_low, binary.ci_high],
        "threshold_s": BOOTSTRAP_LIMIT_S,
        "pass": binary_s < BOOTSTRAP_LIMIT_S,
    }


def _roots() -> DataRoots:
    return DataRoots(
        resolve_data_path("../shared/data/benchmarks"), resolve_data_path("../shared/data/corpora")
    )


async def _timed(
    args: argparse.Namespace, batch: int, concurrency: int, cache: ResponseCache | None
) -> tuple[TaskRun, float, int]:
    backend = OpenAIBackend(
        args.endpoint, args.model, cache=cache, token=args.token, batch_size=batch, concurrency=concurrency
    )
    try:
        identity = await backend.identity()
        started = time.perf_counter()
        run = await run_task(load_task(args.task), _roots(), backend, identity, limit=args.limit, seed=0)
        return run, time.perf_counter() - started, backend.stats.model_calls
    finally:
        await backend.aclose()


async def bench_throughput(args: argparse.Namespace) -> dict[str, Any]:
    sequential, seq_s, _ = await _timed(args, 1, 1, None)
    concurrent, con_s, _ = await _timed(args, args.batch_size, args.concurrency, None)
    identical = sequential.samples == concurrent.samples and sequential.summary == concurrent.summary
    speedup = seq_s / con_s
    return {
        "bench": "eval_throughput",
        "task": args.task,
        "examples": len(sequential.samples),
        "sequential_s": round(seq_s, 3),
        "concurrent_s": round(con_s, 3),
        "speedup": round(speedup, 2),
        "identical": identical,
        "threshold_speedup": SPEEDUP_TARGET,
        "pass": identical and speedup >= SPEEDUP_TARGET,
    }


async def bench_rerun(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        cache = ResponseCache(Path(folder) / "cache.sqlite")
        first, first_s, first_calls = await _timed(args, args.batch_size, args.concurrency, cache)
        second, second_s, second_calls = await _timed(args, args.batch_size, args.concurrency, cache)
        cache.close()
    identical = (first.spec_hash, first.summary) == (second.spec_hash, second.summary)
    return {
        "bench": "eval_rerun",
        "first_s": round(first_s, 3),
        "first_model_calls": first_calls,
        "rerun_s": round(second_s, 3),
        "rerun_model_calls": second_calls,
        "identical": identical,
        "pass": identical and second_calls == 0,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("bench", choices=["bootstrap", "throughput", "rerun"])
    parser.add_argument("--endpoint", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="")
    parser.add_argument("--token", default="", help="bearer token of the endpoint")
    parser.add_argument("--task", default="mmlu")
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    if args.bench == "bootstrap":
        result = bench_bootstrap()
    else:
        if not args.model:
            parser.error("--model is required for throughput and rerun")
        result = asyncio.run(bench_throughput(args) if args.bench == "throughput" else bench_rerun(args))
    print(json.dumps(result, sort_keys=True))
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
