"""``forge load inference``, the serving benchmark contract, run as a user runs it."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from forge_inference_gateway.bench.loadgen import arrival_gaps, parse_goodput

pytestmark = pytest.mark.integration
FORGE = str(Path(sys.executable).parent / "forge")
CONTRACT_KEYS = {"request_throughput", "output_throughput", "completed", "failed"} | {
    f"{stat}_{metric}_ms" for stat in ("mean", "median", "p99") for metric in ("ttft", "tpot", "itl", "e2el")
}


def test_arrivals_are_gamma_with_the_asked_rate_and_slos_parse() -> None:
    gaps = arrival_gaps(4000, rate=20.0, burstiness=1.0, seed=3)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 20, rel=0.05)
    assert arrival_gaps(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]
    assert parse_goodput(["ttft:500,tpot:50", "e2el:2000"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 2000.0}
    with pytest.raises(ValueError, match="ttft:MS"):
        parse_goodput(["latency:5"])


async def forge(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        FORGE, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode()


async def test_forge_load_inference_writes_vllm_keys_and_plots(
    replicas: Callable[..., Awaitable[Any]], tmp_path: Path
) -> None:
    upstream = await replicas(token_delay_s=0.002)
    code, output = await forge(
        "load", "inference", "--base-url", upstream.url, "--model", "tiny", "--max-concurrency", "4",
        "--num-prompts", "12", "--output-len", "6", "--goodput", "ttft:5000", "--out", str(tmp_path),
    )  # fmt: skip
    assert code == 0, output
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results) >= CONTRACT_KEYS and "request_goodput" in results
    assert (results["completed"], results["failed"]) == (12, 0)
    assert results["total_output_tokens"] == sum(int(b["max_tokens"]) for b in upstream.bodies)
    assert (tmp_path / "latency_cdf.png").stat().st_size > 1000
    code, output = await forge(
        "load", "inference", "--base-url", upstream.url, "--model", "tiny", "--num-prompts", "0",
        "--request-rate", "5", "--out", str(tmp_path / "bad"),
    )  # fmt: skip
    assert code == 2 and "--num-prompts must be at least 1" in output
