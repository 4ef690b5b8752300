"""Engine throughput against Hugging Face ``generate`` on the same weights, in one run.

    python load/inference/bench_engine.py --out DIR [--model-dir HF_FOLDER] [--num-requests 64]
        [--min-prompt 8 --max-prompt 512 --min-output 16 --max-output 256] [--hf-batch-size 16] [--seed 0]
        [--threads 1]

Workload: ``num-requests`` requests offered at once, prompt lengths uniform in [min, max] tokens
(random token ids), output lengths uniform in [min, max], greedy, EOS ignored so every system
produces exactly the same number of tokens. Without ``--model-dir`` a randomly initialised Llama
of the policy's shape (4 layers x 256 hidden, 4 heads, vocab 2048, context 1024) is used.

- ``engine_tok_s``: the model_server engine core (continuous batching, paged cache) with every
  request admitted at once;
- ``hf_static_tok_s``: ``LlamaForCausalLM.generate`` in static batches of ``--hf-batch-size``
  (left-padded; a batch runs until its longest output is done; only requested tokens count);
- ``sequential_tok_s``: ``generate`` one request at a time.

All three run with the same torch thread count (default 1: on a shared 2-core machine more
threads than free cores made small matmuls 17x slower). Output tokens per second of wall time each; writes ``DIR/engine_bench.json`` with those three keys
(and the ratios) and prints it as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from forge_model_server.engine import EngineConfig, EngineCore
from forge_model_server.llama import LlamaModel
from forge_model_server.sampling import SamplingParams


def random_model(folder: Path, seed: int) -> Path:
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


def workload(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    return [
        (
            [rng.randrange(vocab) for _ in range(rng.randint(args.min_prompt, args.max_prompt))],
            rng.randint(args.min_output, args.max_output),
        )
        for _ in range(args.num_requests)
    ]


def bench_engine(folder: Path, requests: list[tuple[list[int], int]]) -> tuple[float, int]:
    block_size = 16
    blocks = sum(-(-(len(p) + n) // block_size) for p, n in requests)
    config = EngineConfig(
        num_blocks=blocks,
        block_size=block_size,
        max_num_seqs=len(requests),
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,
    )
    model = LlamaModel.load(folder, num_blocks=blocks, block_size=block_size)
    core = EngineCore(model, config, lambda ids: "")
    start = time.perf_counter()
    for i, (prompt, n) in enumerate(requests):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        core.add_request(str(i), prompt, params, seed=i)
    produced = 0
    while core.has_work():
        produced += sum(len(o.token_ids) for o in core.step())
    return time.perf_counter() - start, produced


def bench_hf(
    model: LlamaForCausalLM, requests: list[tuple[list[int], int]], batch_size: int
) -> tuple[float, int]:
    start = time.perf_counter()
    produced = 0
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
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=0,
            )
            produced += sum(n for _, n in batch)
    return time.perf_counter() - start, produced


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=8)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--min-output", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads for all three (0: torch's default)"
    )
    args = parser.parse_args(argv)
    if not (1 <= args.min_prompt <= args.max_prompt and 1 <= args.min_output <= args.max_output):
        parser.error("length ranges must satisfy 1 <= min <= max")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model_dir or random_model(Path(tmp) / "model", args.seed)
        hf = LlamaForCausalLM.from_pretrained(folder).eval()
        requests = workload(args, hf.config.vocab_size)
        if max(len(p) + n for p, n in requests) > hf.config.max_position_embeddings:
            parser.error("prompt + output lengths exceed the model's max_position_embeddings")
        engine_s, engine_tokens = bench_engine(folder, requests)
        static_s, static_tokens = bench_hf(hf, requests, args.hf_batch_size)
        seq_s, seq_tokens = bench_hf(hf, requests, 1)
    result = {
        "engine_tok_s": engine_tokens / engine_s,
        "hf_static_tok_s": static_tokens / static_s,
        "sequential_tok_s": seq_tokens / seq_s,
    }
    result["engine_vs_hf_static"] = result["engine_tok_s"] / result["hf_static_tok_s"]
    result["engine_vs_sequential"] = result["engine_tok_s"] / result["sequential_tok_s"]
    result["output_tokens"] = engine_tokens
    result["threads"] = torch.get_num_threads()
    result["num_requests"] = args.num_requests
    (args.out / "engine_bench.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
