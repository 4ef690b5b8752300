"""Serving load with vLLM's ``bench serve`` methodology, against any OpenAI-compatible server.

``forge load inference --base-url URL --model NAME (--request-rate R | --max-concurrency C)
--num-prompts N --out DIR`` (see :mod:`forge_inference_gateway.bench.load_cli`) runs it; the gateway's own
benchmarks (``load/inference/bench_gateway.py``) call :func:`run` and :func:`summarize` directly.

Method (as vLLM's ``benchmarks/serve.py``):
- arrivals: gaps drawn from a gamma distribution with shape ``burstiness`` and mean ``1/rate``
  (``burstiness`` 1 is a Poisson process; ``--request-rate inf`` sends everything at once);
  ``--max-concurrency`` caps requests in flight (alone: a closed loop of C clients);
- prompt and output lengths uniform in ``[len*(1-range_ratio), len*(1+range_ratio)]``; prompts are
  words drawn at random from a fixed word list, cut to the length in tokens with ``--tokenizer``
  (else the length is in words), outputs are forced to their length with ``ignore_eos``;
- streaming ``/v1/completions``; TTFT = first content chunk; ITL = gaps between content chunks;
  TPOT = (E2EL - TTFT) / (output tokens - 1); E2EL = the whole request; output tokens from the usage
  chunk; goodput = requests per second meeting every SLO given with ``--goodput``.

Writes ``DIR/results.json`` with vLLM's keys (``request_throughput``, ``output_throughput``,
``mean_ttft_ms``, ``median_ttft_ms``, ``p99_ttft_ms`` and the same for ``tpot``, ``itl``, ``e2el``,
``completed``, ``failed``, …), ``DIR/latency_cdf.png``, and with sweep rates one result per rate
plus ``DIR/throughput_vs_rate.png``.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "a",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "I",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "she",
    "there",
    "been",
    "one",
    "all",
    "we",
    "their",
    "has",
    "would",
    "when",
    "if",
    "so",
    "no",
    "will",
    "more",
    "time",
    "king",
    "lord",
    "love",
    "death",
    "night",
    "sleep",
    "heart",
    "blood",
    "crown",
    "sword",
    "honour",
    "grace",
    "fortune",
    "question",
    "nobler",
    "mind",
    "suffer",
    "slings",
    "arrows",
    "outrageous",
    "take",
    "arms",
    "against",
    "sea",
    "troubles",
    "opposing",
    "end",
    "dream",
]


@dataclass
class RequestResult:
    """One request as the client saw it."""

    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    success: bool = False
    error: str = ""


@dataclass(frozen=True)
class Workload:
    prompts: list[str]
    output_lens: list[int]


def make_workload(
    n: int, input_len: int, output_len: int, range_ratio: float, seed: int, tokenizer_dir: str | None = None
) -> Workload:
    """Prompts of the drawn lengths: in tokens of ``tokenizer_dir`` when given, else in words."""
    rng = random.Random(seed)

    def length(mean: int) -> int:
        low, high = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
        return rng.randint(low, high)

    lengths = [length(input_len) for _ in range(n)]
    if tokenizer_dir is None:
        prompts = [" ".join(rng.choice(WORDS) for _ in range(k)) for k in lengths]
    else:
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
        prompts = []
        for k in lengths:
            ids = tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(k)))[:k]
            prompts.append(tokenizer.decode(ids))
    return Workload(prompts, [length(output_len) for _ in range(n)])


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds to wait before each request: gamma(shape=burstiness, mean=1/rate), 0 for rate inf."""
    if math.isinf(rate):
        return [0.0] * n
    gen = np.random.default_rng(seed)
    theta = 1.0 / (rate * burstiness)
    return [float(g) for g in gen.gamma(shape=burstiness, scale=theta, size=n)]


async def send(client: httpx.AsyncClient, model: str, prompt: str, output_len: int) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult(prompt_len=len(prompt.split()))
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", "/v1/completions", json=body) as reply:
            if reply.status_code != 200:
                result.error = f"HTTP {reply.status_code}: {(await reply.aread())[:200]!r}"
                return result
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = str(event["error"])
                    return result
                now = time.perf_counter()
                if event.get("usage"):
                    result.output_len = int(event["usage"]["completion_tokens"])
                    result.prompt_len = int(event["usage"]["prompt_tokens"])
                if event.get("choices") and event["choices"][0].get("text"):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.latency = time.perf_counter() - start
        result.success = result.ttft > 0
        if not result.success:
            result.error = "no tokens received"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = repr(exc)
    return result


async def run(
    base_url: str,
    model: str,
    workload: Workload,
    rate: float,
    max_concurrency: int | None,
    burstiness: float,
    seed: int,
    api_key: str | None,
    on_done: Callable[[], None] = lambda: None,
) -> tuple[list[RequestResult], float]:
    """Send the workload on its arrival schedule; return the results and the wall time.
    ``on_done`` is called as each request finishes (for a progress bar)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    gaps = arrival_gaps(len(workload.prompts), rate, burstiness, seed)
    timeout = httpx.Timeout(600.0)
    limits = httpx.Limits(max_connections=max_concurrency or 1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=timeout, limits=limits
    ) as client:

        async def one(i: int) -> RequestResult:
            if limit is None:
                result = await send(client, model, workload.prompts[i], workload.output_lens[i])
            else:
                async with limit:
                    result = await send(client, model, workload.prompts[i], workload.output_lens[i])
            on_done()
            return result

        start = time.perf_counter()
        tasks = []
        for i, gap in enumerate(gaps):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(i)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def summarize(
    results: list[RequestResult], duration: float, goodput: dict[str, float]
) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """vLLM's result keys; latencies in milliseconds."""
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    series = {
        "ttft": [r.ttft * 1000 for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_len - 1) * 1000 for r in ok if r.output_len > 1],
        "itl": [gap * 1000 for r in ok for gap in r.itl],
        "e2el": [r.latency * 1000 for r in ok],
    }
    summary: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
    }
    for name, values in series.items():
        arr = np.array(values) if values else np.zeros(1)
        summary[f"mean_{name}_ms"] = float(arr.mean())
        summary[f"median_{name}_ms"] = float(np.median(arr))
        summary[f"std_{name}_ms"] = float(arr.std())
        for p in (90, 99):
            summary[f"p{p}_{name}_ms"] = float(np.percentile(arr, p))
    if goodput:
        good = 0
        for r in ok:
            tpot = (r.latency - r.ttft) / (r.output_len - 1) * 1000 if r.output_len > 1 else 0.0
            measured = {"ttft": r.ttft * 1000, "tpot": tpot, "e2el": r.latency * 1000}
            good += all(measured[k] <= v for k, v in goodput.items())
        summary["request_goodput"] = good / duration if duration else 0.0
    errors = sorted({r.error for r in results if r.error})
    if errors:
        summary["errors"] = errors[:5]
    return summary, series


def plot_cdfs(series: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 3.5))
    for ax, (name, values) in zip(axes, series.items(), strict=True):
        if values:
            xs = np.sort(values)
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs))
        ax.set_title(f"{name.upper()} CDF")
        ax.set_xlabel("ms")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of samples")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_sweep(points: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    rates = [p["request_rate"] for p in points]
    left.plot(rates, [p["output_throughput"] for p in points], marker="o")
    left.set_xlabel("offered request rate (req/s)")
    left.set_ylabel("output tokens/s")
    right.plot(rates, [p["p99_ttft_ms"] for p in points], marker="o", label="p99 TTFT")
    right.plot(rates, [p["median_ttft_ms"] for p in points], marker="o", label="median TTFT")
    right.set_xlabel("offered request rate (req/s)")
    right.set_ylabel("ms")
    right.legend()
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_goodput(items: list[str]) -> dict[str, float]:
    """``ttft:500`` → ``{"ttft": 500.0}``; items may also be comma separated."""
    slos: dict[str, float] = {}
    for item in (part for entry in items for part in entry.split(",") if part):
        name, _, value = item.partition(":")
        try:
            slos[name] = float(value)
        except ValueError:
            name = ""
        if name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput: expected ttft:MS, tpot:MS or e2el:MS, got {item!r}")
    return slos


@dataclass(frozen=True)
class LoadSpec:
    """One load run, as ``forge load inference`` takes it."""

    base_url: str
    model: str
    num_prompts: int
    out: Path
    request_rate: float = math.inf
    max_concurrency: int | None = None
    burstiness: float = 1.0
    input_len: int = 128
    output_len: int = 64
    range_ratio: float = 0.5
    goodput: dict[str, float] = field(default_factory=dict)
    sweep_rates: tuple[float, ...] = ()
    api_key: str | None = None
    tokenizer: str | None = None
    seed: int = 0

    def check(self) -> None:
        """Refuse a spec that cannot run, naming the option."""
        if self.num_prompts < 1:
            raise ValueError("--num-prompts must be at least 1")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be at least 1")
        if not self.request_rate > 0:
            raise ValueError("--request-rate must be positive (or inf)")
        if not self.burstiness > 0:
            raise ValueError("--burstiness must be positive")
        if not 0 <= self.range_ratio < 1:
            raise ValueError("--range-ratio must be in [0, 1)")
        if any(not r > 0 for r in self.sweep_rates):
            raise ValueError("--sweep-rates must all be positive")


def run_load(
    spec: LoadSpec, progress: Callable[[str, int], Callable[[], None]] = lambda phase, total: lambda: None
) -> dict[str, Any]:
    """Run ``spec``, write its results and plots under ``spec.out``, and return the summary.
    ``progress(phase, requests)`` returns the callback each finished request of that phase calls."""
    spec.check()
    spec.out.mkdir(parents=True, exist_ok=True)
    workload = make_workload(
        spec.num_prompts, spec.input_len, spec.output_len, spec.range_ratio, spec.seed, spec.tokenizer
    )

    def once(rate: float) -> tuple[list[RequestResult], float]:
        return asyncio.run(
            run(
                spec.base_url,
                spec.model,
                workload,
                rate,
                spec.max_concurrency,
                spec.burstiness,
                spec.seed,
                spec.api_key,
                progress(f"rate {rate:g}/s" if math.isfinite(rate) else "all at once", len(workload.prompts)),
            )
        )

    results, duration = once(spec.request_rate)
    summary, series = summarize(results, duration, spec.goodput)
    summary.update(
        model=spec.model,
        request_rate=spec.request_rate if math.isfinite(spec.request_rate) else "inf",
        max_concurrency=spec.max_concurrency,
        burstiness=spec.burstiness,
        num_prompts=spec.num_prompts,
    )
    plot_cdfs(series, spec.out / "latency_cdf.png")
    if spec.sweep_rates:
        points = []
        for rate in spec.sweep_rates:
            point, _ = summarize(*once(rate), spec.goodput)
            points.append({"request_rate": rate, **point})
        (spec.out / "sweep.json").write_text(json.dumps(points, indent=2))
        plot_sweep(points, spec.out / "throughput_vs_rate.png")
    (spec.out / "results.json").write_text(json.dumps(summary, indent=2))
    return summary
