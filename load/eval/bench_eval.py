"""Eval benchmarks with thresholds (see README.md for where each number comes from).

    python load/eval/bench_eval.py bootstrap
        paired bootstrap, 10,000 resamples over 10,000 paired 0/1 examples (and over continuous
        scores); threshold: under 1 s for the 0/1 case.
    python load/eval/bench_eval.py checkpoint --out DIR
        write the benchmark's model: a random 2-layer, 64-wide Llama with a 256-token context and a
        300-token byte-level BPE (Hugging Face format), as the model_server tests build it.
    python load/eval/bench_eval.py throughput (--serve DIR | --endpoint URL --model NAME) [--task T]
        the same spec sequentially (batch 1, one request in flight) and concurrently (batch 16,
        --concurrency in flight), cache off, alternated --repeat times; the best time of each is
        compared (on a shared machine the best run is the one least disturbed).
        Threshold: at least 5x faster with identical samples and summary in every repetition.
    python load/eval/bench_eval.py rerun (--serve DIR | --endpoint URL --model NAME) [--task T]
        a run and a re-run of the unchanged spec through one cache; threshold: zero model calls on
        the re-run and an identical summary and report.

``--serve DIR`` starts a ``forge_model_server`` on the checkpoint folder for the benchmark (the
same :class:`~forge_eval.serving.LocalModelServer` eval uses for ``serve_model`` runs) and stops it
afterwards; ``--server-env KEY=VALUE`` passes model-server settings to it.

Each prints one JSON line with the figures and ``"pass": true|false`` and exits 1 on a miss.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np

from forge_eval import stats
from forge_eval.backend import OpenAIBackend, ResponseCache
from forge_eval.harness import TaskRun, run_report, run_task, write_run
from forge_eval.serving import LocalModelServer
from forge_eval.tasks import DataRoots, load_task
from forge_kit.paths import resolve_data_path

BOOTSTRAP_LIMIT_S = 1.0
SPEEDUP_TARGET = 5.0
CORPUS = "corpora/tinyshakespeare/input.txt"


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


def make_checkpoint(out: Path) -> dict[str, Any]:
    """The benchmark model (random weights, seeded): what matters is the serving cost, not quality."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([resolve_data_path(CORPUS).read_text()[:20_000]], trainer=trainer)
    eot = "<|endoftext|>"
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=eot, eos_token=eot, unk_token=eot, pad_token=eot
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=bpe.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=0,
    )
    out.mkdir(parents=True, exist_ok=True)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return {"bench": "checkpoint", "out": str(out), "pass": True}


def _roots() -> DataRoots:
    return DataRoots(resolve_data_path("benchmarks"), resolve_data_path("corpora"))


@contextlib.asynccontextmanager
async def _endpoint(args: argparse.Namespace) -> AsyncIterator[None]:
    """Serve ``--serve`` for the benchmark (setting ``--endpoint``, ``--model``, ``--token``)."""
    if not args.serve:
        yield
        return
    env = dict(item.split("=", 1) for item in args.server_env)
    host = LocalModelServer(env={f"FORGE_MODEL_SERVER_{k}": v for k, v in env.items()})
    folder = Path(args.serve).resolve()
    async with host.serve(folder.name, "bench", folder) as served:
        args.endpoint, args.model, args.token = served.endpoint, served.model, served.token
        yield


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
    async with _endpoint(args):
        await _timed(args, 1, 1, None)  # warm-up: load the weights, fill the allocator
        sequential_s, concurrent_s, identical = [], [], True
        reference: TaskRun | None = None
        for _ in range(args.repeat):
            sequential, seq_s, _ = await _timed(args, 1, 1, None)
            concurrent, con_s, _ = await _timed(args, args.batch_size, args.concurrency, None)
            reference = reference or sequential
            for run in (sequential, concurrent):
                identical &= (run.samples, run.summary) == (reference.samples, reference.summary)
            sequential_s.append(round(seq_s, 3))
            concurrent_s.append(round(con_s, 3))
    assert reference is not None
    speedup = min(sequential_s) / min(concurrent_s)
    return {
        "bench": "eval_throughput",
        "task": args.task,
        "examples": len(reference.samples),
        "concurrency": args.concurrency,
        "sequential_s": sequential_s,
        "concurrent_s": concurrent_s,
        "speedup": round(speedup, 2),
        "median_speedup": round(float(np.median(np.array(sequential_s) / np.array(concurrent_s))), 2),
        "identical": identical,
        "threshold_speedup": SPEEDUP_TARGET,
        "pass": identical and speedup >= SPEEDUP_TARGET,
    }


async def bench_rerun(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        cache = ResponseCache(Path(folder) / "cache.sqlite")
        async with _endpoint(args):
            first, first_s, first_calls = await _timed(args, args.batch_size, args.concurrency, cache)
            second, second_s, second_calls = await _timed(args, args.batch_size, args.concurrency, cache)
        cache.close()
        reports = []
        for name, run in (("first", first), ("second", second)):
            summary = write_run(Path(folder) / name, [run], {"model": {"name": args.model}})
            reports.append(run_report(summary))
    identical = (first.spec_hash, first.summary) == (second.spec_hash, second.summary) and reports[
        0
    ] == reports[1]
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
    parser.add_argument("bench", choices=["bootstrap", "checkpoint", "throughput", "rerun"])
    parser.add_argument("--endpoint", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="")
    parser.add_argument(
        "--token-file",
        default="",
        help="file holding the endpoint's bearer token (else $FORGE_CLI_EVAL_ENDPOINT_TOKEN); never on the command line",
    )
    parser.add_argument("--serve", default="", help="checkpoint folder to serve for the benchmark")
    parser.add_argument("--server-env", action="append", default=[], help="KEY=VALUE model-server setting")
    parser.add_argument("--out", default="var/bench/eval-checkpoint/tiny", help="checkpoint: where to write")
    parser.add_argument("--task", default="mmlu")
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3, help="throughput: alternated repetitions")
    args = parser.parse_args()
    token_file = Path(args.token_file) if args.token_file else None
    args.token = (
        token_file.read_text().strip() if token_file else os.environ.get("FORGE_CLI_EVAL_ENDPOINT_TOKEN", "")
    )
    if args.bench == "bootstrap":
        result = bench_bootstrap()
    elif args.bench == "checkpoint":
        result = make_checkpoint(Path(args.out))
    else:
        if not args.model and not args.serve:
            parser.error("--serve DIR or --model NAME is required for throughput and rerun")
        result = asyncio.run(bench_throughput(args) if args.bench == "throughput" else bench_rerun(args))
    print(json.dumps(result, sort_keys=True))
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
