"""``forge bench engine --out DIR``: the engine against Hugging Face ``generate`` on the same
weights and the same requests, in one run.

Workload: ``num_requests`` requests offered at once, prompt lengths uniform in
[``min_prompt``, ``max_prompt``] tokens (random token ids), output lengths uniform in
[``min_output``, ``max_output``], greedy, EOS ignored so every system produces exactly the same
number of tokens. Without ``--model-dir`` a randomly initialised Llama (4 layers x 256 hidden,
4 heads, vocab 2048, context 1024) is used.

1. ``engine_tok_s``: the engine core (continuous batching, paged KV cache, chunked prefill under
   ``max_num_batched_tokens``) with every request admitted at once. The budget defaults to 2048, a
   throughput setting (vLLM's own defaults are in the thousands), rather than the model server's
   latency-minded 512: on this workload it makes most prompts one chunk (no context to gather back
   from the cache);
2. ``hf_static_tok_s``: ``LlamaForCausalLM.generate`` in static batches of ``hf_batch_size``
   (left-padded; a batch runs until its longest output is done; only requested tokens count);
3. ``sequential_tok_s``: ``generate`` one request at a time.

Output tokens per second of wall time each, all three with the same torch thread count (default
1: more threads than free cores make small matmuls many times slower).
Writes ``DIR/summary.json`` with those three keys, ``engine_vs_hf_static``,
``engine_vs_sequential``, the same two ratios in CPU seconds of this process (``cpu_s``,
``engine_vs_hf_static_cpu``, ``engine_vs_sequential_cpu``: time slices other jobs take do not count
there), ``identical_to_sequential`` (requests whose engine tokens equal
the one-at-a-time ``generate`` tokens) and ``decode_attention`` (the engine's decode path:
``native`` kernel or ``torch`` matmuls, per ``--decode-attention``), and prints it as one JSON line.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any, cast, get_args

import torch
import typer
from transformers import LlamaConfig, LlamaForCausalLM

from forge_kit import clitools
from forge_model_server.engine.core import EngineConfig, EngineCore
from forge_model_server.model.llama import DecodeAttention, LlamaModel
from forge_model_server.sample.sampler import SamplingParams

app = typer.Typer(add_completion=False, help="Inference engine benchmark (engine).")

Request = tuple[list[int], int]
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Timing:
    """Wall seconds and this process's CPU seconds of one system's run."""

    wall_s: float
    cpu_s: float


class _Clock:
    def __init__(self) -> None:
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def stop(self) -> Timing:
        return Timing(time.perf_counter() - self._wall, time.process_time() - self._cpu)


@dataclass(frozen=True)
class EngineBench:
    """One run's workload and settings; :func:`validate` names the first bad field."""

    num_requests: int = 64
    min_prompt: int = 8
    max_prompt: int = 512
    min_output: int = 16
    max_output: int = 256
    hf_batch_size: int = 16
    max_num_batched_tokens: int = 2048
    seed: int = 0
    threads: int = 1
    decode_attention: DecodeAttention = "auto"


def validate(bench: EngineBench) -> None:
    if bench.num_requests < 1:
        raise typer.BadParameter("must be at least 1", param_hint="--num-requests")
    if not 1 <= bench.min_prompt <= bench.max_prompt:
        raise typer.BadParameter("needs 1 <= --min-prompt <= --max-prompt", param_hint="--min-prompt")
    if not 1 <= bench.min_output <= bench.max_output:
        raise typer.BadParameter("needs 1 <= --min-output <= --max-output", param_hint="--min-output")
    if bench.hf_batch_size < 1:
        raise typer.BadParameter("must be at least 1", param_hint="--hf-batch-size")
    if bench.max_num_batched_tokens < 1:
        raise typer.BadParameter("must be at least 1", param_hint="--max-num-batched-tokens")
    if bench.threads < 0:
        raise typer.BadParameter("must be 0 (torch's default) or more", param_hint="--threads")


def random_model(folder: Path, seed: int) -> Path:
    """A randomly initialised Llama of the default shape, saved in Hugging Face format."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def workload(bench: EngineBench, vocab: int) -> list[Request]:
    rng = random.Random(bench.seed)
    return [
        (
            [rng.randrange(vocab) for _ in range(rng.randint(bench.min_prompt, bench.max_prompt))],
            rng.randint(bench.min_output, bench.max_output),
        )
        for _ in range(bench.num_requests)
    ]


def run_engine(
    folder: Path, requests: list[Request], budget: int, decode_attention: DecodeAttention = "auto"
) -> tuple[Timing, list[list[int]], str]:
    """Time to serve every request with all of them admitted at once, their tokens, and which decode
    attention ran."""
    blocks = sum(-(-(len(p) + n) // BLOCK_SIZE) for p, n in requests)
    config = EngineConfig(
        num_blocks=blocks,
        block_size=BLOCK_SIZE,
        max_num_seqs=len(requests),
        max_num_batched_tokens=budget,
        enable_prefix_caching=False,
    )
    model = LlamaModel.load(
        folder, num_blocks=blocks, block_size=BLOCK_SIZE, decode_attention=decode_attention
    )
    core = EngineCore(model, config, lambda ids: "")
    produced: dict[str, list[int]] = {str(i): [] for i in range(len(requests))}
    clock = _Clock()
    for i, (prompt, n) in enumerate(requests):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        core.add_request(str(i), prompt, params, seed=i)
    while core.has_work():
        for out in core.step():
            produced[out.request_id] += out.token_ids
    return clock.stop(), list(produced.values()), model.decode_attention


def run_hf(
    model: LlamaForCausalLM, requests: list[Request], batch_size: int
) -> tuple[Timing, list[list[int]]]:
    """Time for ``generate`` over static batches of ``batch_size``, and the requested tokens."""
    outputs: list[list[int]] = []
    clock = _Clock()
    with torch.inference_mode():
        for b in range(0, len(requests), batch_size):
            batch = requests[b : b + batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for row, (prompt, _) in enumerate(batch):
                ids[row, width - len(prompt) :] = torch.tensor(prompt)
                mask[row, width - len(prompt) :] = 1
            longest = max(n for _, n in batch)
            generated = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=0,
            )
            outputs += [generated[row, width : width + n].tolist() for row, (_, n) in enumerate(batch)]
    return clock.stop(), outputs


def engine_bench(
    bench: EngineBench, model_dir: Path | None = None, stage: Callable[[str], None] = lambda name: None
) -> dict[str, Any]:
    """1. the engine, 2. static batches, 3. one request at a time; the summary of the three.
    ``stage(name)`` is called as each part begins (for a progress bar)."""
    validate(bench)
    before = torch.get_num_threads()
    if bench.threads > 0:
        torch.set_num_threads(bench.threads)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            folder = model_dir or random_model(Path(tmp) / "model", bench.seed)
            hf = LlamaForCausalLM.from_pretrained(folder).eval()
            requests = workload(bench, hf.config.vocab_size)
            longest = max(len(p) + n for p, n in requests)
            if longest > hf.config.max_position_embeddings:
                raise typer.BadParameter(
                    f"prompt + output reach {longest} tokens; the model's context is "
                    f"{hf.config.max_position_embeddings}",
                    param_hint="--max-prompt",
                )
            stage("the engine")
            engine_s, engine_tokens, decode_path = run_engine(
                folder, requests, bench.max_num_batched_tokens, bench.decode_attention
            )
            stage("HF generate, static batches")
            static_s, _ = run_hf(hf, requests, bench.hf_batch_size)
            stage("HF generate, one request at a time")
            sequential_s, sequential_tokens = run_hf(hf, requests, 1)
        threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    tokens = sum(n for _, n in requests)
    if sum(map(len, engine_tokens)) != tokens:
        raise RuntimeError(f"the engine produced {sum(map(len, engine_tokens))} tokens, not {tokens}")
    summary: dict[str, Any] = {
        "engine_tok_s": tokens / engine_s.wall_s,
        "hf_static_tok_s": tokens / static_s.wall_s,
        "sequential_tok_s": tokens / sequential_s.wall_s,
    }
    summary["engine_vs_hf_static"] = summary["engine_tok_s"] / summary["hf_static_tok_s"]
    summary["engine_vs_sequential"] = summary["engine_tok_s"] / summary["sequential_tok_s"]
    # The same ratios in CPU time: on a shared machine wall time also counts the time slices other
    # jobs took, which changes over one run (the three parts run minutes apart).
    summary["cpu_s"] = {
        "engine": engine_s.cpu_s,
        "hf_static": static_s.cpu_s,
        "sequential": sequential_s.cpu_s,
    }
    summary["engine_vs_hf_static_cpu"] = static_s.cpu_s / engine_s.cpu_s
    summary["engine_vs_sequential_cpu"] = sequential_s.cpu_s / engine_s.cpu_s
    summary["identical_to_sequential"] = sum(
        a == b for a, b in zip(engine_tokens, sequential_tokens, strict=True)
    )
    summary["output_tokens"] = tokens
    summary["threads"] = threads
    summary["decode_attention"] = decode_path
    summary["settings"] = asdict(bench)
    return summary


def _decode_attention(value: str) -> DecodeAttention:
    choices = get_args(DecodeAttention)
    if value not in choices:
        raise typer.BadParameter(
            f"{value!r} is not one of {', '.join(choices)}", param_hint="--decode-attention"
        )
    return cast(DecodeAttention, value)


@app.callback()
def bench() -> None:
    """Benchmarks (``forge bench engine``)."""


@app.command()
def engine(
    out: Annotated[Path, typer.Option(help="directory for summary.json")],
    model_dir: Annotated[
        Path | None, typer.Option(help="a Hugging Face Llama folder (default: a random one)")
    ] = None,
    num_requests: Annotated[int, typer.Option(help="requests, all offered at once")] = 64,
    min_prompt: Annotated[int, typer.Option(help="shortest prompt, tokens")] = 8,
    max_prompt: Annotated[int, typer.Option(help="longest prompt, tokens")] = 512,
    min_output: Annotated[int, typer.Option(help="shortest output, tokens")] = 16,
    max_output: Annotated[int, typer.Option(help="longest output, tokens")] = 256,
    hf_batch_size: Annotated[int, typer.Option(help="requests per static generate batch")] = 16,
    max_num_batched_tokens: Annotated[int, typer.Option(help="the engine's token budget per step")] = 2048,
    seed: Annotated[int, typer.Option(help="workload and random-model seed")] = 0,
    threads: Annotated[int, typer.Option(help="torch intra-op threads for all three (0: torch's)")] = 1,
    decode_attention: Annotated[
        str, typer.Option(help="the engine's decode attention: auto, native (the kernel) or torch")
    ] = "auto",
    quiet: Annotated[bool, clitools.QuietOption] = False,
) -> None:
    """Engine throughput against HF generate (static batches, one at a time), same weights."""
    settings = EngineBench(
        num_requests=num_requests,
        min_prompt=min_prompt,
        max_prompt=max_prompt,
        min_output=min_output,
        max_output=max_output,
        hf_batch_size=hf_batch_size,
        max_num_batched_tokens=max_num_batched_tokens,
        seed=seed,
        threads=threads,
        decode_attention=_decode_attention(decode_attention),
    )
    if model_dir is not None and not (model_dir / "config.json").is_file():
        raise typer.BadParameter(f"{model_dir} has no config.json", param_hint="--model-dir")
    with clitools.stages(3, quiet) as stage:
        summary = engine_bench(settings, model_dir, stage)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    typer.echo(json.dumps(summary))
