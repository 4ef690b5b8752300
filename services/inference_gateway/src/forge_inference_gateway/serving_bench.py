"""``forge bench serving --out DIR``: one model, one workload, three targets — Forge's engine
(``model_server``) directly, vLLM directly, and vLLM through the gateway.

Real: a random Llama (default hidden 512, 10 layers, 8 heads: head size 64, which vLLM's CPU
attention serves; 26M parameters) is saved once; a ``forge_model_server`` process serves it, then
a vLLM server (:mod:`forge_kit.vllm`, from ``.venv-vllm``) and a ``forge_inference_gateway``
process in front of that vLLM. Both engines run float32, so they do the same arithmetic.

1. **Load** (each target in turn, one at a time on the machine): ``--num-prompts`` streamed
   completions of ``--input-len`` prompt tokens and exactly ``--output-len`` output tokens
   (``ignore_eos``), ``--max-concurrency`` in flight (:mod:`forge_inference_gateway.loadgen`,
   vLLM's ``bench serve`` method), after a warm-up.
2. **Gateway overhead** at idle: ``--pairs`` single requests, each sent to vLLM directly and
   through the gateway back to back (the order alternating), so both see the same engine state;
   overhead = p50 TTFT through the gateway − p50 TTFT direct. Under load the TTFTs are mostly
   queueing and two separate runs differ by more than the hop costs; the loaded p50s are kept
   beside it.

Writes ``DIR/summary.json``: per target ``tokens_per_s`` (output tokens per second of wall
time), ``ttft_ms.p50/p99``, ``itl_ms.p50/p99``, ``completed``/``failed``; ``ratios.
forge_vs_vllm_throughput``; ``gateway_overhead_ms.ttft_p50``; the model, workload and command.
"""

from __future__ import annotations

import asyncio
import json
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

from forge_inference_gateway import loadgen
from forge_kit.testing import ServiceProcess
from forge_kit.testing.processes import VllmServer, free_port
from forge_kit.vllm import VllmLaunch

TOKEN = "bench-serving-token"
API_KEY = "bench-serving-key"
MODEL = "bench"
TARGETS = ("forge", "vllm", "vllm_via_gateway")
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
    return ServiceProcess(
        "forge_model_server",
        env={
            "FORGE_MODEL_SERVER_GRPC_PORT": "0",
            "FORGE_MODEL_SERVER_HTTP_PORT": "0",
            "FORGE_MODEL_SERVER_AUTH_TOKEN": TOKEN,
            "FORGE_MODEL_SERVER_MODELS_DIR": str(models),
            "FORGE_MODEL_SERVER_KAFKA_ENABLED": "false",
            "FORGE_MODEL_SERVER_TORCH_THREADS": str(threads),
            "FORGE_MODEL_SERVER_MAX_NUM_SEQS": str(max_seqs),
            "FORGE_MODEL_SERVER_NUM_KV_BLOCKS": "2048",
            "FORGE_MODEL_SERVER_LOG_LEVEL": "WARNING",
        },
        cwd=str(work),
        log_path=str(work / "model_server.log"),
    ).start(300)


def start_gateway(upstream: str, work: Path) -> ServiceProcess:
    return ServiceProcess(
        "forge_inference_gateway",
        env={
            "FORGE_INFERENCE_GATEWAY_GRPC_PORT": "0",
            "FORGE_INFERENCE_GATEWAY_HTTP_PORT": "0",
            "FORGE_INFERENCE_GATEWAY_AUTH_TOKEN": TOKEN,
            "FORGE_INFERENCE_GATEWAY_DATA_DIR": str(work / "gateway"),
            "FORGE_INFERENCE_GATEWAY_KAFKA_ENABLED": "false",
            "FORGE_INFERENCE_GATEWAY_MODEL_SERVER_URL": upstream,
            "FORGE_INFERENCE_GATEWAY_MODEL_SERVER_TOKEN": TOKEN,
            "FORGE_INFERENCE_GATEWAY_BOOTSTRAP_API_KEY": API_KEY,
            "FORGE_INFERENCE_GATEWAY_DEFAULT_RPM_LIMIT": "100000000",
            "FORGE_INFERENCE_GATEWAY_RESPONSE_CACHE_TTL_S": "0",
            "FORGE_INFERENCE_GATEWAY_LOG_LEVEL": "WARNING",
        },
        cwd=str(work),
        log_path=str(work / "gateway.log"),
    ).start(120)


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


async def load(base_url: str, key: str, workload: loadgen.Workload, concurrency: int) -> dict[str, Any]:
    """Step 1 for one target: a warm-up, then the workload; the contract's figures."""
    warm = loadgen.Workload(workload.prompts[:concurrency], [4] * min(concurrency, len(workload.prompts)))
    await loadgen.run(base_url, MODEL, warm, float("inf"), concurrency, 1.0, 0, key)
    results, duration = await loadgen.run(base_url, MODEL, workload, float("inf"), concurrency, 1.0, 0, key)
    ok = [r for r in results if r.success]
    # A random model's tokens may never make a whole UTF-8 character: vLLM then streams no text
    # at all (it holds back half characters; Forge's engine sends U+FFFD), but the usage counts
    # the tokens. Such a request completed: its tokens count, it has no TTFT or ITL.
    textless = [r for r in results if not r.success and r.error == "no tokens received" and r.output_len]
    tokens = sum(r.output_len for r in ok + textless)
    return {
        "tokens_per_s": round(tokens / duration, 1) if duration else 0.0,
        "ttft_ms": percentiles([r.ttft * 1000 for r in ok]),
        "itl_ms": percentiles([g * 1000 for r in ok for g in r.itl]),
        "completed": len(ok) + len(textless),
        "completed_without_text": len(textless),
        "failed": len(results) - len(ok) - len(textless),
        "output_tokens": tokens,
        "duration_s": round(duration, 2),
        "errors": sorted({r.error for r in results if r.error and r not in textless})[:3],
    }


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
    workload = loadgen.make_workload(
        args["num_prompts"], args["input_len"], args["output_len"], 0.0, args["seed"], str(models / MODEL)
    )
    targets: dict[str, Any] = {}
    typer.echo(f"model: {params / 1e6:.1f}M parameters; forge model_server …", err=True)
    forge = start_forge(models, work, args["threads"], args["max_concurrency"])
    try:
        await wait_listed(forge.http_url, TOKEN)
        targets["forge"] = await load(forge.http_url, TOKEN, workload, args["max_concurrency"])
    finally:
        forge.stop()
    typer.echo(f"  forge: {targets['forge']['tokens_per_s']} tokens/s; vLLM …", err=True)
    launch = VllmLaunch(
        models / MODEL,
        free_port(),
        MODEL,
        api_key=TOKEN,
        kv_cache_gib=2,
        threads=args["threads"],
        engine_args={"dtype": "float32", "max_model_len": 1024, "max_num_seqs": args["max_concurrency"]},
    )
    vllm = VllmServer(launch, log_path=str(work / "vllm.log")).start(600)
    gateway: ServiceProcess | None = None
    try:
        targets["vllm"] = await load(vllm.url, TOKEN, workload, args["max_concurrency"])
        typer.echo(f"  vllm: {targets['vllm']['tokens_per_s']} tokens/s; gateway …", err=True)
        gateway = start_gateway(vllm.url, work)
        await wait_listed(gateway.http_url, API_KEY)
        targets["vllm_via_gateway"] = await load(gateway.http_url, API_KEY, workload, args["max_concurrency"])
        # Prompts of their own: none the load phase sent.
        fresh = loadgen.make_workload(
            args["pairs"], args["input_len"], 8, 0.0, args["seed"] + 1, str(models / MODEL)
        )
        overhead = await paired_ttft(vllm.url, gateway.http_url, fresh.prompts, 8)
    finally:
        if gateway is not None:
            gateway.stop()
        vllm.stop()
    forge_tps, vllm_tps = targets["forge"]["tokens_per_s"], targets["vllm"]["tokens_per_s"]
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
            k: args[k] for k in ("num_prompts", "input_len", "output_len", "max_concurrency", "threads")
        },
        "targets": targets,
        "ratios": {"forge_vs_vllm_throughput": round(forge_tps / vllm_tps, 3) if vllm_tps else None},
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
    hidden: Annotated[int, typer.Option(min=64, max=2048)] = 512,
    layers: Annotated[int, typer.Option(min=1, max=32)] = 10,
    heads: Annotated[int, typer.Option(min=1, max=32, help="Attention heads (head size hidden/heads).")] = 8,
    threads: Annotated[int, typer.Option(min=0, max=64, help="Engine threads (0: one per core).")] = 0,
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
