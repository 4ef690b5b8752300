"""The inference gateway's targets, measured against a real model_server process in one run.

    python load/inference/bench_gateway.py --out DIR [--model-dir HF_FOLDER] [--scenarios overhead,overload]
        [--concurrency 50] [--overhead-prompts 200] [--rounds 2] [--input-len 32] [--output-len 32]
        [--interactive-rate 4] [--overload-factor 3] [--overload-s 30] [--threads 1]
        [--max-inflight 8] [--reserve 0.5]

Starts one model_server (``--threads`` torch threads) on 127.0.0.1 and, per scenario, a gateway
process in front of it; stops them all at the end. The model server serves two random Llamas with a
byte-level BPE tokenizer: ``policy`` (the policy's shape, 4 layers x 256 hidden; or ``--model-dir``)
and ``tiny`` (2 x 64). The gateway's response cache is off (the workloads repeat prompts at
temperature 0, which it would otherwise answer itself).

1. ``overhead`` — the target "gateway overhead against direct calls to the model server at 50
   concurrent streams: p50 added latency <= 2 ms, p99 <= 10 ms". ``--concurrency`` streams
   (model ``tiny``, so the gateway's cost is not lost in the engine's) in a closed loop of pairs:
   ``--overhead-prompts`` x ``--rounds`` requests, half of them direct and half through the
   gateway, a pair's two sent at the same moment (on a shared machine, separate runs drift by
   more than the effect); the gateway admits 64 per replica, so nothing queues there; added
   latency = the percentiles of gateway - direct per pair, for TTFT and E2EL (see
   :func:`overhead`). The
   gateway's CPU per request and per token is reported too: it does not depend on how busy the
   machine is.
2. ``overload`` (model ``policy``, the gateway admitting ``--max-inflight`` per replica with
   ``--reserve`` of it held for interactive traffic) — "with batch traffic offered at 3x capacity, interactive TTFT p99 stays within 2x
   of its unloaded value and no interactive request is rejected". Capacity = requests/s the model
   server sustains on the batch workload in a closed loop of 64; interactive traffic (the bootstrap
   tenant, class interactive) arrives as a Poisson process at ``--interactive-rate``, first alone,
   then beside batch traffic (a tenant of class batch) offered at ``--overload-factor`` x capacity.

Writes ``DIR/gateway_bench.json`` (every figure, each target with ``met``) and prints it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from forge_inference_gateway.bench.loadgen import RequestResult, make_workload, run, send
from forge_kit.stats import percentile
from forge_kit.testing import ServiceProcess
from forge_kit.testing.processes import cpu_seconds

TOKEN = "bench-token"
INTERACTIVE_KEY = "bench-interactive-key"
CORPUS = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 8


def random_model(folder: Path, seed: int, hidden: int, layers: int) -> Path:
    """A random Llama (``layers`` x ``hidden``) with a byte-level BPE tokenizer, in HF format."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([CORPUS], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=bpe.get_vocab_size(),
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def start_model_server(models_dir: Path, work: Path, args: argparse.Namespace) -> ServiceProcess:
    return ServiceProcess(
        "forge_model_server",
        env={
            "FORGE_MODEL_SERVER_GRPC_PORT": "0",
            "FORGE_MODEL_SERVER_HTTP_PORT": "0",
            "FORGE_MODEL_SERVER_AUTH_TOKEN": TOKEN,
            "FORGE_MODEL_SERVER_MODELS_DIR": str(models_dir),
            "FORGE_MODEL_SERVER_KAFKA_ENABLED": "false",
            "FORGE_MODEL_SERVER_TORCH_THREADS": str(args.threads),
            "FORGE_MODEL_SERVER_MAX_WAITING_REQUESTS": "4096",
            "FORGE_MODEL_SERVER_LOG_LEVEL": "WARNING",
        },
        cwd=str(work),
        log_path=str(work / "model_server.log"),
    ).start(120)


def start_gateway(
    server: ServiceProcess, work: Path, name: str, max_inflight: int, reserve: float
) -> ServiceProcess:
    return ServiceProcess(
        "forge_inference_gateway",
        env={
            "FORGE_INFERENCE_GATEWAY_GRPC_PORT": "0",
            "FORGE_INFERENCE_GATEWAY_HTTP_PORT": "0",
            "FORGE_INFERENCE_GATEWAY_AUTH_TOKEN": TOKEN,
            "FORGE_INFERENCE_GATEWAY_DATA_DIR": str(work / f"gateway-{name}"),
            "FORGE_INFERENCE_GATEWAY_KAFKA_ENABLED": "false",
            "FORGE_INFERENCE_GATEWAY_MODEL_SERVER_URL": server.http_url,
            "FORGE_INFERENCE_GATEWAY_MODEL_SERVER_TOKEN": TOKEN,
            "FORGE_INFERENCE_GATEWAY_BOOTSTRAP_API_KEY": INTERACTIVE_KEY,
            "FORGE_INFERENCE_GATEWAY_DEFAULT_RPM_LIMIT": "100000000",
            "FORGE_INFERENCE_GATEWAY_RESPONSE_CACHE_TTL_S": "0",
            "FORGE_INFERENCE_GATEWAY_MAX_INFLIGHT_PER_REPLICA": str(max_inflight),
            "FORGE_INFERENCE_GATEWAY_INTERACTIVE_RESERVE": str(reserve),
            "FORGE_INFERENCE_GATEWAY_LOG_LEVEL": "WARNING",
        },
        cwd=str(work),
        log_path=str(work / f"gateway-{name}.log"),
    ).start(60)


def percentiles(values: list[float]) -> dict[str, float]:
    stats = {f"p{p}": percentile(values, p) for p in (50, 90, 99)}
    return stats | {"n": len(values)}


def ms(results: list[RequestResult], what: str) -> list[float]:
    return [(r.ttft if what == "ttft" else r.latency) * 1000 for r in results if r.success]


async def overhead(
    direct: str, gateway: str, args: argparse.Namespace, gateway_pid: int | None
) -> dict[str, Any]:
    """Closed loop of ``concurrency / 2`` client pairs: each pair sends one request direct and one
    through the gateway at the same moment, with the same prompt behind a different first word (so
    the model server's prefix cache cannot favour either) and the same output length, then the
    next pair. Both of a pair meet the same engine steps, so their difference is the gateway's
    added latency for that request, free of the engine's step-to-step spread, which is tens of ms
    at 50 streams: ``added_*`` are percentiles of those per-pair differences, in the steady state
    (every pair but the loops' first ones, which all arrive in the same millisecond and queue in
    the gateway behind each other: ``added_*_with_first_wave`` counts them too). The percentile of
    each path minus the other's (the earlier estimator) is kept as ``added_*_unpaired``."""
    pairs = max(1, args.overhead_prompts * args.rounds // 2)
    workload = make_workload(pairs, args.input_len, args.output_len, 0.5, 1)
    paths: dict[str, list[RequestResult]] = {"direct": [], "gateway": []}
    sent: list[float] = []
    first_wave: list[bool] = []  # the loops' first pairs, all sent in the same millisecond
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    direct_client = httpx.AsyncClient(
        base_url=direct, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=600, limits=limits
    )
    gateway_client = httpx.AsyncClient(
        base_url=gateway, headers={"Authorization": f"Bearer {INTERACTIVE_KEY}"}, timeout=600, limits=limits
    )
    todo = iter(range(pairs))
    start = time.perf_counter()

    async def pair_loop() -> None:
        opening = True
        for i in todo:
            prompt, n = workload.prompts[i], workload.output_lens[i]
            at = 1000 * (time.perf_counter() - start)
            d, g = await asyncio.gather(
                send(direct_client, "tiny", f"direct {prompt}", n),
                send(gateway_client, "tiny", f"gateway {prompt}", n),
            )
            paths["direct"].append(d)
            paths["gateway"].append(g)
            sent.append(at)
            first_wave.append(opening)
            opening = False

    before = cpu_seconds(gateway_pid)
    async with direct_client, gateway_client:
        await asyncio.gather(*(pair_loop() for _ in range(max(1, args.concurrency // 2))))
    gateway_cpu = cpu_seconds(gateway_pid) - before
    tokens = sum(r.output_len for r in paths["gateway"])
    out: dict[str, Any] = {
        "concurrency": args.concurrency,
        "requests_per_path": len(paths["direct"]),
        # Independent of how busy the machine is: what the gateway itself spends per request.
        "gateway_cpu_ms_per_request": 1000 * gateway_cpu / max(1, len(paths["gateway"])),
        "gateway_cpu_us_per_token": 1e6 * gateway_cpu / max(1, tokens),
    }
    for name, results in paths.items():
        out[name] = {
            "failed": sum(not r.success for r in results),
            "ttft_ms": percentiles(ms(results, "ttft")),
            "e2el_ms": percentiles(ms(results, "e2el")),
        }
    both = [
        (d, g, t, w)
        for d, g, t, w in zip(paths["direct"], paths["gateway"], sent, first_wave, strict=True)
        if d.success and g.success
    ]
    steady = [pair for pair in both if not pair[3]]
    for metric, what in (("ttft_ms", "ttft"), ("e2el_ms", "e2el")):
        for key, chosen in ((f"added_{metric}", steady), (f"added_{metric}_with_first_wave", both)):
            paired = percentiles([ms([g], what)[0] - ms([d], what)[0] for d, g, _, _ in chosen])
            out[key] = paired | {"pairs": paired.pop("n")}
        out[f"added_{metric}_unpaired"] = {
            p: out["gateway"][metric][p] - out["direct"][metric][p] for p in ("p50", "p99")
        }
    # Every pair, for a look at the tail: [sent at (ms from the start of the loop), direct TTFT,
    # gateway TTFT, direct E2EL, gateway E2EL (ms), first wave (0/1)].
    args.out.mkdir(parents=True, exist_ok=True)
    detail = [
        [t, *ms([d], "ttft"), *ms([g], "ttft"), *ms([d], "e2el"), *ms([g], "e2el"), int(w)]
        for d, g, t, w in both
    ]
    (args.out / "overhead_pairs.json").write_text(json.dumps(detail))
    added = out["added_ttft_ms"]
    out["target"] = {"p50_added_ms_max": 2.0, "p99_added_ms_max": 10.0}
    out["met"] = bool(steady) and added["p50"] <= 2.0 and added["p99"] <= 10.0
    return out


async def overload(
    direct: str, gateway: str, args: argparse.Namespace, gateway_pid: int | None
) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=gateway, timeout=10) as admin:
        reply = await admin.post(
            "/admin/v1/tenants",
            json={"name": "bench-batch", "priority_class": "batch", "rpm_limit": 100_000_000},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        reply.raise_for_status()
        batch_key = reply.json()["api_key"]
    # Capacity: what the model server sustains on the batch workload, closed loop of 64.
    probe = make_workload(128, args.input_len, args.output_len, 0.5, 2)
    results, duration = await run(direct, "policy", probe, math.inf, 64, 1.0, 2, TOKEN)
    capacity = sum(r.success for r in results) / duration
    n_interactive = max(10, int(args.interactive_rate * args.overload_s))
    interactive = make_workload(n_interactive, args.input_len, args.output_len, 0.5, 3)
    alone, _ = await run(gateway, "policy", interactive, args.interactive_rate, None, 1.0, 3, INTERACTIVE_KEY)
    batch_rate = args.overload_factor * capacity
    batch = make_workload(max(1, int(batch_rate * args.overload_s)), args.input_len, args.output_len, 0.5, 4)
    (loaded, _), (batch_results, batch_s) = await asyncio.gather(
        run(gateway, "policy", interactive, args.interactive_rate, None, 1.0, 3, INTERACTIVE_KEY),
        run(gateway, "policy", batch, batch_rate, None, 1.0, 4, batch_key),
    )
    unloaded_p99 = percentiles(ms(alone, "ttft"))["p99"]
    loaded_p99 = percentiles(ms(loaded, "ttft"))["p99"]
    rejected = [r.error for r in loaded if not r.success]
    out = {
        "capacity_req_s": capacity,
        "batch_offered_req_s": batch_rate,
        "batch_sent": len(batch_results),
        "batch_completed": sum(r.success for r in batch_results),
        "batch_shed_429": sum(r.error.startswith("HTTP 429") for r in batch_results),
        "batch_goodput_req_s": sum(r.success for r in batch_results) / batch_s,
        "interactive_rate": args.interactive_rate,
        "interactive_sent": len(loaded),
        "interactive_ttft_ms_unloaded": percentiles(ms(alone, "ttft")),
        "interactive_ttft_ms_loaded": percentiles(ms(loaded, "ttft")),
        "interactive_failed_unloaded": sum(not r.success for r in alone),
        "interactive_rejected_loaded": len(rejected),
        "interactive_errors": sorted(set(rejected))[:3],
        "p99_ratio": loaded_p99 / unloaded_p99 if unloaded_p99 else None,
        "p50_ratio": (
            percentiles(ms(loaded, "ttft"))["p50"] / percentiles(ms(alone, "ttft"))["p50"] if alone else None
        ),
        "target": {"p99_ratio_max": 2.0, "interactive_rejected": 0},
    }
    out["met"] = bool(out["p99_ratio"] is not None and out["p99_ratio"] <= 2.0 and not rejected)
    return out


async def warm_up(direct: str, gateway: str) -> None:
    """Load both models and open connections before anything is timed."""
    for url, key in ((direct, TOKEN), (gateway, INTERACTIVE_KEY)):
        headers = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as client:
            for model in ("tiny", "policy"):
                body = {"model": model, "prompt": "To be", "max_tokens": 4, "temperature": 0}
                for _ in range(3):
                    (await client.post("/v1/completions", json=body)).raise_for_status()


def run_scenario(name: str, server: ServiceProcess, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One scenario behind a gateway process configured for it."""
    inflight, reserve = (64, 0.25) if name == "overhead" else (args.max_inflight, args.reserve)
    gateway = start_gateway(server, work, name, inflight, reserve)
    scenario = overhead if name == "overhead" else overload

    async def measured() -> dict[str, Any]:
        await warm_up(server.http_url, gateway.http_url)
        return await scenario(server.http_url, gateway.http_url, args, gateway.pid)

    try:
        before = os.getloadavg()[0]
        result = asyncio.run(measured())
        # On a shared machine, say how busy it was, since latency figures move with it.
        result["load_average_1m"] = [round(before, 2), round(os.getloadavg()[0], 2)]
        return result
    finally:
        gateway.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--scenarios", default="overhead,overload")
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--overhead-prompts", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--interactive-rate", type=float, default=4.0)
    parser.add_argument("--overload-factor", type=float, default=3.0)
    parser.add_argument("--overload-s", type=float, default=30.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-inflight", type=int, default=8)
    parser.add_argument("--reserve", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    scenarios = [s for s in args.scenarios.split(",") if s]
    if not set(scenarios) <= {"overhead", "overload"}:
        parser.error("--scenarios: overhead and/or overload")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        models = work / "models"
        random_model(models / "tiny", args.seed, hidden=64, layers=2)
        if args.model_dir is not None:
            (models / "policy").symlink_to(args.model_dir.resolve())
        else:
            random_model(models / "policy", args.seed, hidden=256, layers=4)
        server = start_model_server(models, work, args)
        result: dict[str, Any] = {"model_server_threads": args.threads}
        try:
            for name in scenarios:
                result[name] = run_scenario(name, server, work, args)
        finally:
            server.stop()
    (args.out / "gateway_bench.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
