"""``forge bench serving --out DIR``: one model, one workload, three targets — Forge's engine
(``model_server``) directly, vLLM directly, and vLLM through the gateway.

Real: a random Llama (default hidden 512, 10 layers, 8 heads: head size 64, which vLLM's CPU
attention serves; 26M parameters) is saved once; a ``forge_model_server`` process serves it, then
a vLLM server (:mod:`forge_kit.vllm`, from ``.venv-vllm``) and a ``forge_inference_gateway``
process in front of that vLLM. Both engines run float32, so they do the same arithmetic, with the
same step budget (:data:`MAX_NUM_BATCHED_TOKENS`) and, with ``--threads N``, N threads (0: each
engine's default: one for Forge's forward, one per core for vLLM's OpenMP).

1. **Load**, in ``--rounds`` rounds: in each round every target in turn (one at a time on the
   machine; the order reversed every other round) gets ``--num-prompts`` streamed completions of
   ``--input-len`` prompt tokens and exactly ``--output-len`` output tokens (``ignore_eos``),
   ``--max-concurrency`` in flight (:mod:`forge_inference_gateway.bench.loadgen`, vLLM's ``bench
   serve`` method), after one warm-up per target. All three servers are up for the whole load, so
   the targets take turns minutes apart instead of one after the other's whole run: on a machine
   shared with other work, whose load changes by the minute, each round's targets see about the
   same load, and the ratio of a round compares the engines under it. Every round draws prompts
   of its own (as does the warm-up), so no target finds a prompt in its prefix cache.
2. **Gateway overhead** at idle: ``--pairs`` single requests, each sent to vLLM directly and
   through the gateway back to back (the order alternating), so both see the same engine state;
   overhead = p50 TTFT through the gateway − p50 TTFT direct. Under load the TTFTs are mostly
   queueing and two separate runs differ by more than the hop costs; the loaded p50s are kept
   beside it.

Writes ``DIR/summary.json``: per target ``tokens_per_s`` (output tokens over the wall time of
its rounds together), ``tokens_per_server_cpu_s`` (over the CPU seconds its server processes
used meanwhile: on a shared machine what an engine gets done with the CPU it got, where tokens per
second also counts how much CPU the scheduler gave it), ``ttft_ms.p50/p99``, ``itl_ms.p50/p99``
(over all its rounds' requests), ``completed``/``failed`` and ``rounds`` (each round's figures
and the machine's load average before and after it); ``ratios.forge_vs_vllm_throughput`` (of
those totals), ``forge_vs_vllm_throughput_per_round`` and ``forge_vs_vllm_tokens_per_server_cpu_s``;
``gateway_overhead_ms.ttft_p50``; the model, workload and command.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import httpx
import numpy as np
import typer

from forge_inference_gateway.bench import loadgen, start_gateway
from forge_inference_gateway.bench import start_model_server as launch_model_server
from forge_kit.testing import ServiceProcess
from forge_kit.testing.processes import VllmServer, free_port
from forge_kit.vllm import VllmLaunch

TOKEN = "bench-serving-token"
API_KEY = "bench-serving-key"
MODEL = "bench"
TARGETS = ("forge", "vllm", "vllm_via_gateway")
#: Tokens one engine step may compute, in both engines: vLLM-CPU's default for its API server
#: (Forge's model server defaults to a latency-minded 512).
MAX_NUM_BATCHED_TOKENS = 2048
#: What the target's TTFT target is judged against (the issue's benchmark contract).
GATEWAY_OVERHEAD_TARGET_MS = 5.0


def save_model(folder: Path, hidden: int, layers: int, heads: int, context: int, seed: int) -> int:
    """The random Llama every target serves; returns its parameter count."""
    from forge_kit.testing.tiny_llama import save_tiny_llama

    save_tiny_llama(
        folder, hidden=hidden, layers=layers, heads=heads, kv_heads=heads, context=context, seed=seed
    )
    config = json.loads((folder / "config.json").read_text())
    h, inter, v, n = config["hidden_size"], config["intermediate_size"], config["vocab_size"], layers
    return 2 * v * h + n * (4 * h * h + 3 * h * inter + 2 * h) + h


def start_forge(models: Path, work: Path, threads: int, max_seqs: int) -> ServiceProcess:
    settings = {
        "MAX_NUM_SEQS": str(max_seqs),
        "MAX_NUM_BATCHED_TOKENS": str(MAX_NUM_BATCHED_TOKENS),
        "NUM_KV_BLOCKS": "2048",
        # 0: the engine's own default, as vLLM gets no OMP_NUM_THREADS then.
        **({"TORCH_THREADS": str(threads)} if threads else {}),
    }
    return launch_model_server(
        models, work, TOKEN, log_name="model_server.log", settings=settings, timeout_s=300
    )


async def wait_listed(base_url: str, key: str, timeout_s: float = 60.0) -> None:
    """Until ``base_url`` lists the bench model (the gateway has scraped its replica)."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {key}"}) as client:
        while time.monotonic() < deadline:
            reply = await client.get("/v1/models")
            if reply.is_success and MODEL in {m["id"] for m in reply.json()["data"]}:
                return
            await asyncio.sleep(0.2)
    raise TimeoutError(f"{base_url} did not list {MODEL} within {timeout_s:g}s")


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None}
    return {
        "p50": round(float(np.percentile(values, 50)), 2),
        "p99": round(float(np.percentile(values, 99)), 2),
    }


async def warm_up(base_url: str, key: str, prompts: list[str]) -> None:
    """Short requests, all at once: the target has compiled, allocated and connected."""
    workload = loadgen.Workload(prompts, [4] * len(prompts))
    await loadgen.run(base_url, MODEL, workload, float("inf"), len(prompts), 1.0, 0, key)


def server_pid(server: ServiceProcess | VllmServer) -> int:
    assert server.proc is not None, "the server is running"
    return server.proc.pid


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` and its live descendants, read from /proc;
    0 where /proc has no such process (or no /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        children = [
            int(child)
            for task in Path(f"/proc/{pid}/task").iterdir()
            for child in (task / "children").read_text().split()
        ]
    except (OSError, IndexError, ValueError):
        return 0.0
    return total + sum(tree_cpu_s(child) for child in children)


async def load_round(
    base_url: str, key: str, workload: loadgen.Workload, concurrency: int, pids: list[int]
) -> dict[str, Any]:
    """One round of step 1 on one target: its results, wall time, the load average around it and
    the CPU seconds its server processes (``pids`` and their children) used meanwhile."""
    before = round(os.getloadavg()[0], 2)
    cpu = sum(tree_cpu_s(pid) for pid in pids)
    results, duration = await loadgen.run(base_url, MODEL, workload, float("inf"), concurrency, 1.0, 0, key)
    return {
        "results": results,
        "duration": duration,
        "loadavg": (before, round(os.getloadavg()[0], 2)),
        "cpu_s": sum(tree_cpu_s(pid) for pid in pids) - cpu,
    }


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """A target's contract figures over its rounds, and each round's throughput."""
    results = [r for one in rounds for r in one["results"]]
    duration = sum(one["duration"] for one in rounds)
    per_round = []
    for one in rounds:
        tokens = sum(counted_tokens(r) for r in one["results"])
        per_round.append(
            {
                "tokens_per_s": round(tokens / one["duration"], 1) if one["duration"] else 0.0,
                "duration_s": round(one["duration"], 2),
                "loadavg_before_after": one["loadavg"],
                "server_cpu_s": round(one["cpu_s"], 2),
                "tokens_per_server_cpu_s": round(tokens / one["cpu_s"], 1) if one["cpu_s"] else None,
            }
        )
    ok = [r for r in results if r.success]
    textless = [r for r in results if is_textless(r)]
    tokens = sum(counted_tokens(r) for r in results)
    cpu = sum(one["cpu_s"] for one in rounds)
    return {
        "tokens_per_s": round(tokens / duration, 1) if duration else 0.0,
        "tokens_per_server_cpu_s": round(tokens / cpu, 1) if cpu else None,
        "ttft_ms": percentiles([r.ttft * 1000 for r in ok]),
        "itl_ms": percentiles([g * 1000 for r in ok for g in r.itl]),
        "completed": len(ok) + len(textless),
        "completed_without_text": len(textless),
        "failed": len(results) - len(ok) - len(textless),
        "output_tokens": tokens,
        "duration_s": round(duration, 2),
        "rounds": per_round,
        "errors": sorted({r.error for r in results if r.error and not is_textless(r)})[:3],
    }


def is_textless(result: loadgen.RequestResult) -> bool:
    """A random model's tokens may never make a whole UTF-8 character: vLLM then streams no text
    at all (it holds back half characters; Forge's engine sends U+FFFD), but the usage counts
    the tokens. Such a request completed: its tokens count, it has no TTFT or ITL."""
    return not result.success and result.error == "no tokens received" and bool(result.output_len)


def counted_tokens(result: loadgen.RequestResult) -> int:
    return result.output_len if result.success or is_textless(result) else 0


async def first_event_ms(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> float:
    """Milliseconds from sending a streamed completion to its first event with a choice (its
    text may still be empty: a byte-level tokenizer's first token can be half a character)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    started = time.perf_counter()
    first: float | None = None
    async with client.stream("POST", "/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{client.base_url}: HTTP {reply.status_code} {(await reply.aread())[:200]!r}")
        async for line in reply.aiter_lines():
            if first is None and line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                first = time.perf_counter()
    if first is None:
        raise RuntimeError(f"{client.base_url}: a stream without a choice")
    return (first - started) * 1000


async def paired_ttft(direct: str, gateway: str, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    """Step 2: each prompt to vLLM directly and through the gateway, back to back."""
    ttft: dict[str, list[float]] = {"direct": [], "gateway": []}
    async with (
        httpx.AsyncClient(base_url=direct, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as d,
        httpx.AsyncClient(base_url=gateway, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as g,
    ):
        for i, prompt in enumerate(prompts):
            order = [("direct", d), ("gateway", g)]
            for name, client in order if i % 2 == 0 else order[::-1]:
                ttft[name].append(await first_event_ms(client, prompt, max_tokens))
    gaps = [b - a for a, b in zip(ttft["direct"], ttft["gateway"], strict=True)]
    return {
        "pairs": len(prompts),
        "direct_ttft_ms": percentiles(ttft["direct"]),
        "gateway_ttft_ms": percentiles(ttft["gateway"]),
        "ttft_p50": round(statistics.median(ttft["gateway"]) - statistics.median(ttft["direct"]), 2),
        "paired_difference_p50": round(statistics.median(gaps), 2),
    }


async def run_bench(args: dict[str, Any], work: Path) -> dict[str, Any]:
    models = work / "models"
    params = save_model(models / MODEL, args["hidden"], args["layers"], args["heads"], 1024, args["seed"])
    folder, seed, concurrency = str(models / MODEL), args["seed"], args["max_concurrency"]

    def prompts(n: int, input_len: int, output_len: int, seed: int) -> loadgen.Workload:
        return loadgen.make_workload(n, input_len, output_len, 0.0, seed, folder)

    # Seeds of their own: the warm-up, each round and the idle pairs never share a prompt.
    warm = prompts(concurrency, args["input_len"], 4, seed + 1000).prompts
    workloads = [
        prompts(args["num_prompts"], args["input_len"], args["output_len"], seed + 2000 + i)
        for i in range(args["rounds"])
    ]
    typer.echo(f"model: {params / 1e6:.1f}M parameters; forge model_server, vLLM, gateway …", err=True)
    launch = VllmLaunch(
        models / MODEL,
        free_port(),
        MODEL,
        api_key=TOKEN,
        kv_cache_gib=2,
        threads=args["threads"],
        engine_args={
            "dtype": "float32",
            "max_model_len": 1024,
            "max_num_seqs": concurrency,
            "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
        },
    )
    forge = start_forge(models, work, args["threads"], concurrency)
    vllm: VllmServer | None = None
    gateway: ServiceProcess | None = None
    rounds: dict[str, list[dict[str, Any]]] = {t: [] for t in TARGETS}
    try:
        vllm = VllmServer(launch, log_path=str(work / "vllm.log")).start(600)
        gateway = start_gateway([vllm.url], work, TOKEN, API_KEY, timeout_s=120)
        endpoints = {
            "forge": (forge.http_url, TOKEN),
            "vllm": (vllm.url, TOKEN),
            "vllm_via_gateway": (gateway.http_url, API_KEY),
        }
        pids = {
            "forge": [server_pid(forge)],
            "vllm": [server_pid(vllm)],
            "vllm_via_gateway": [server_pid(gateway), server_pid(vllm)],
        }
        await wait_listed(forge.http_url, TOKEN)
        await wait_listed(gateway.http_url, API_KEY)
        for target in TARGETS:
            await warm_up(*endpoints[target], warm)
        for i, workload in enumerate(workloads):
            for target in TARGETS if i % 2 == 0 else TARGETS[::-1]:
                rounds[target].append(
                    await load_round(*endpoints[target], workload, concurrency, pids[target])
                )
                done = rounds[target][-1]
                tps = sum(counted_tokens(r) for r in done["results"]) / done["duration"]
                typer.echo(f"  round {i + 1}: {target} {tps:.1f} tokens/s", err=True)
        fresh = prompts(args["pairs"], args["input_len"], 8, seed + 1).prompts
        overhead = await paired_ttft(vllm.url, gateway.http_url, fresh, 8)
    finally:
        if gateway is not None:
            gateway.stop()
        if vllm is not None:
            vllm.stop()
        forge.stop()
    targets = {target: summarize(rounds[target]) for target in TARGETS}
    per_round = [
        round(f["tokens_per_s"] / v["tokens_per_s"], 3) if v["tokens_per_s"] else None
        for f, v in zip(targets["forge"]["rounds"], targets["vllm"]["rounds"], strict=True)
    ]
    forge_tps, vllm_tps = targets["forge"]["tokens_per_s"], targets["vllm"]["tokens_per_s"]
    per_cpu = targets["forge"]["tokens_per_server_cpu_s"], targets["vllm"]["tokens_per_server_cpu_s"]
    cpu_ratio = round(per_cpu[0] / per_cpu[1], 3) if per_cpu[0] and per_cpu[1] else None
    loaded = targets["vllm_via_gateway"]["ttft_ms"]["p50"], targets["vllm"]["ttft_ms"]["p50"]
    overhead["ttft_p50_under_load"] = round(loaded[0] - loaded[1], 2) if None not in loaded else None
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(args["argv"]),
        "model": {
            "parameters": params,
            "hidden": args["hidden"],
            "layers": args["layers"],
            "heads": args["heads"],
            "head_dim": args["hidden"] // args["heads"],
            "dtype": "float32",
        },
        "workload": {
            k: args[k]
            for k in ("num_prompts", "input_len", "output_len", "max_concurrency", "threads", "rounds")
        },
        "targets": targets,
        "ratios": {
            "forge_vs_vllm_throughput": round(forge_tps / vllm_tps, 3) if vllm_tps else None,
            "forge_vs_vllm_throughput_per_round": per_round,
            "forge_vs_vllm_tokens_per_server_cpu_s": cpu_ratio,
        },
        "gateway_overhead_ms": overhead,
        "targets_met": {
            "gateway_overhead_ttft_p50_at_most_5ms": overhead["ttft_p50"] <= GATEWAY_OVERHEAD_TARGET_MS,
            "forge_throughput_at_least_vllm": bool(vllm_tps) and forge_tps >= vllm_tps,
        },
    }


def serving(
    out: Annotated[Path, typer.Option(help="Directory for summary.json.")],
    num_prompts: Annotated[int, typer.Option(min=1, max=4096)] = 128,
    input_len: Annotated[int, typer.Option(min=1, max=512, help="Prompt tokens.")] = 128,
    output_len: Annotated[int, typer.Option(min=2, max=512, help="Output tokens (ignore_eos).")] = 128,
    max_concurrency: Annotated[int, typer.Option(min=1, max=256)] = 32,
    pairs: Annotated[int, typer.Option(min=1, max=1024, help="Idle requests per arm for the overhead.")] = 64,
    rounds: Annotated[int, typer.Option(min=1, max=16, help="Turns of the workload per target.")] = 2,
    hidden: Annotated[int, typer.Option(min=64, max=2048)] = 512,
    layers: Annotated[int, typer.Option(min=1, max=32)] = 10,
    heads: Annotated[int, typer.Option(min=1, max=32, help="Attention heads (head size hidden/heads).")] = 8,
    threads: Annotated[
        int,
        typer.Option(min=0, max=64, help="Threads of each engine (0: each engine's default)."),
    ] = 0,
    seed: int = 0,
) -> None:
    """Forge's engine, vLLM, and vLLM through the gateway on one model and workload."""
    if hidden % heads or (hidden // heads) % 2:
        raise typer.BadParameter("hidden / heads must be a whole, even head size", param_hint="--heads")
    if input_len + output_len > 1024:
        raise typer.BadParameter(
            "input and output must fit the model's 1024 positions", param_hint="--output-len"
        )
    args: dict[str, Any] = {
        "num_prompts": num_prompts,
        "input_len": input_len,
        "output_len": output_len,
        "max_concurrency": max_concurrency,
        "pairs": pairs,
        "rounds": rounds,
        "hidden": hidden,
        "layers": layers,
        "heads": heads,
        "threads": threads,
        "seed": seed,
    }
    args["argv"] = ["forge", "bench", "serving", "--out", str(out)] + [
        f"--{k.replace('_', '-')} {v}" for k, v in args.items() if k != "argv"
    ]
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="serving-bench-"))
    try:
        summary = asyncio.run(run_bench(args, work))
    finally:
        for log in ("model_server.log", "vllm.log", "gateway.log"):
            if (work / log).exists():
                shutil.copy(work / log, out / log)
        shutil.rmtree(work, ignore_errors=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    brief = {t: {k: summary["targets"][t][k] for k in ("tokens_per_s", "ttft_ms", "itl_ms")} for t in TARGETS}
    shown = {
        "targets": brief,
        "ratios": summary["ratios"],
        "gateway_overhead_ms": summary["gateway_overhead_ms"],
    }
    typer.echo(json.dumps(shown, indent=2))
