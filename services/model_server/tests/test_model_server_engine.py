"""The engine core on a tiny random Llama: logits parity with transformers, continuous batching,
paged blocks and preemption, prefix caching, priority, stops, logprobs and seeds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from forge_model_server.engine.core import EngineConfig, EngineCore, RequestOutput
from forge_model_server.model import paged_plan
from forge_model_server.model.llama import DecodeAttention, LlamaModel
from forge_model_server.model.paged_plan import BatchLayout
from forge_model_server.sample.sampler import SamplingParams

PROMPTS = [
    "To be, or not to be",
    "the slings and arrows of outrageous fortune, or to take arms",
    "heart-ache",
    "Whether 'tis nobler in the mind to suffer the slings",
]


@pytest.fixture(scope="module")
def hf_model(tiny_llama: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(tiny_llama).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(str(tiny_llama))


def make_core(tiny_llama: Path, tokenizer: PreTrainedTokenizerFast, **config: int | bool) -> EngineCore:
    cfg = EngineConfig(**config)  # type: ignore[arg-type]
    model = LlamaModel.load(tiny_llama, num_blocks=cfg.num_blocks, block_size=cfg.block_size)
    return EngineCore(model, cfg, lambda ids: str(tokenizer.decode(ids)), (tokenizer.eos_token_id,))


def greedy(max_tokens: int = 12, **kwargs: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)  # type: ignore[arg-type]


def run_to_end(core: EngineCore, max_steps: int = 500) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not core.has_work():
            return outputs
        for out in core.step():
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError("the engine did not finish")


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def alone(
    tiny_llama: Path, tokenizer: PreTrainedTokenizerFast, prompt: str, params: SamplingParams
) -> list[int]:
    core = make_core(tiny_llama, tokenizer)
    core.add_request("solo", tokenizer.encode(prompt), params, seed=1)
    return tokens(run_to_end(core)["solo"])


def paged_layout(
    tables: dict[str, list[int]], bs: int, chunks: list[tuple[str, torch.Tensor, int]]
) -> BatchLayout:
    """One step computing ``seq[start:]`` of each (name, seq, start) through ``tables[name]``."""
    ids, pos, slots, starts, lens, block_tables = [], [], [], [0], [], []
    for name, seq, start in chunks:
        table = tables[name]
        for p in range(start, len(seq)):
            ids.append(int(seq[p]))
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
        starts.append(len(ids))
        lens.append(len(seq))
        block_tables.append(table)
    return BatchLayout(torch.tensor(ids), torch.tensor(pos), torch.tensor(slots), starts, lens, block_tables)


def random_ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("explicit_scores_max", [paged_plan.EXPLICIT_SCORES_MAX, 0], ids=["explicit", "sdpa"])
def test_paged_forward_matches_transformers_logits(
    tiny_llama: Path, hf_model: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch, explicit_scores_max: int
) -> None:
    """Two sequences in one step, scattered blocks, one of them prefilled in two chunks; prefill
    attention with explicit scores, and through SDPA (the path of large chunks)."""
    monkeypatch.setattr(paged_plan, "EXPLICIT_SCORES_MAX", explicit_scores_max)
    bs = 4
    model = LlamaModel.load(tiny_llama, num_blocks=16, block_size=bs)
    a, b = random_ids(11, 3), random_ids(6, 4)
    tables = {"a": [9, 2, 14], "b": [5, 0]}
    # Step 1: a's first 7 tokens and all of b; step 2: the rest of a, attending to step 1's cache.
    logits1 = model.forward(paged_layout(tables, bs, [("a", a[:7], 0), ("b", b, 0)]), torch.arange(13))
    logits2 = model.forward(paged_layout(tables, bs, [("a", a, 7)]), torch.arange(4))
    with torch.no_grad():
        ref_a = hf_model(a[None]).logits[0]
        ref_b = hf_model(b[None]).logits[0]
    torch.testing.assert_close(torch.cat([logits1[:7], logits2]), ref_a, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits1[7:], ref_b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("decode_attention", ["torch", "native"])
@pytest.mark.parametrize(
    "tables",
    [
        # Dense: the step's blocks are read where they lie; c's shared prefix blocks are gathered.
        {"a": [3, 1, 4], "b": [5, 0], "c": [3, 1, 6]},
        # Sparse (block 39 far away): the blocks are gathered.
        {"a": [9, 2, 14], "b": [5, 39], "c": [9, 2, 20]},
    ],
)
def test_batched_decode_matches_transformers_logits(
    tiny_llama: Path,
    hf_model: LlamaForCausalLM,
    tables: dict[str, list[int]],
    decode_attention: DecodeAttention,
) -> None:
    """Single-token steps of several sequences attend together; c shares a's first two blocks (the
    prefix cache's case) and joins with a prefill chunk beside two decodes. Through torch's batched
    products (read in place or gathered, per ``tables``) and through the native kernel."""
    bs = 4
    model = LlamaModel.load(tiny_llama, num_blocks=40, block_size=bs, decode_attention=decode_attention)
    assert model.decode_attention == decode_attention
    a, b = random_ids(12, 3), random_ids(6, 4)
    c = torch.cat([a[:8], random_ids(3, 5)])
    model.forward(paged_layout(tables, bs, [("a", a[:10], 0), ("b", b[:5], 0)]), torch.arange(15))
    # Step 2: a and b decode one token each; c computes positions 8-9 on a's cached prefix.
    step2 = model.forward(
        paged_layout(tables, bs, [("a", a[:11], 10), ("b", b, 5), ("c", c[:10], 8)]), torch.arange(4)
    )
    # Step 3: a and c decode, reading the two blocks they share.
    step3 = model.forward(paged_layout(tables, bs, [("a", a, 11), ("c", c, 10)]), torch.arange(2))
    with torch.no_grad():
        ref_a, ref_b, ref_c = (hf_model(s[None]).logits[0] for s in (a, b, c))
    got = torch.stack([step2[0], step3[0], step2[1], step2[2], step2[3], step3[1]])
    want = torch.stack([ref_a[10], ref_a[11], ref_b[5], ref_c[8], ref_c[9], ref_c[10]])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_greedy_generation_matches_transformers_generate(
    tiny_llama: Path, tokenizer: PreTrainedTokenizerFast, hf_model: LlamaForCausalLM
) -> None:
    ids = tokenizer.encode(PROMPTS[1])
    ours = alone(tiny_llama, tokenizer, PROMPTS[1], greedy(10))
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=None)
    assert ours == ref[0, len(ids) :].tolist()


def test_continuous_batching_joins_and_leaves_without_changing_tokens(
    tiny_llama: Path, tokenizer: PreTrainedTokenizerFast
) -> None:
    lengths = [12, 5, 9, 7]
    expected = {
        str(i): alone(tiny_llama, tokenizer, p, greedy(n))
        for i, (p, n) in enumerate(zip(PROMPTS, lengths, strict=True))
    }
    # A small token budget forces chunked prefill next to running decodes.
    core = make_core(tiny_llama, tokenizer, max_num_batched_tokens=8)
    outputs: dict[str, list[RequestOutput]] = {}
    joins = {0: [0, 1], 3: [2], 6: [3]}
    batch_sizes = []
    for step in range(200):
        for i in joins.get(step, []):
            core.add_request(str(i), tokenizer.encode(PROMPTS[i]), greedy(lengths[i]), seed=1)
        if not core.has_work():
            break
        batch_sizes.append(len(core.running))
        for out in core.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert {k: tokens(v) for k, v in outputs.items()} == expected
    assert max(batch_sizes) >= 3  # they really shared steps
    assert core.pool.num_free() == core.config.num_blocks


def test_tiny_pool_preempts_by_recompute_and_keeps_outputs(
    tiny_llama: Path, tokenizer: PreTrainedTokenizerFast
) -> None:
    expected = {str(i): alone(tiny_llama, tokenizer, p, greedy(10)) for i, p in enumerate(PROMPTS)}
    # 12 blocks of 4 slots: the longest request alone needs 12, so the others must make room.
    core = make_core(tiny_llama, tokenizer, num_blocks=12, block_size=4, enable_prefix_caching=False)
    for i, prompt in enumerate(PROMPTS):
        core.add_request(str(i), tokenizer.encode(prompt), greedy(10), seed=1)
    outputs = run_to_end(core)
    assert {k: tokens(v) for k, v in outputs.items()} == expected
    assert core.stats.num_preemptions > 0
    assert core.pool.num_free() == 12


def test_a_request_larger_than_the_pool_is_refused(
    tiny_llama: Path, tokenizer: PreTrainedTokenizerFast
) -> None:
    core = make_core(tiny_llama, tokenizer, num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="needs 5 KV blocks; the pool has 4"):
        core.add_request("big", list(range(10)), greedy(10), seed=1)


def test_prefix_cache_reuses_full_prompt_blocks(tiny_llama: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    core = make_core(tiny_llama, tokenizer, block_size=4)
    prompt = tokenizer.encode(PROMPTS[3])
    core.add_request("first", prompt, greedy(6), seed=1)
    first = tokens(run_to_end(core)["first"])
    assert core.stats.prefix_hits == 0
    core.add_request("second", prompt, greedy(6), seed=1)
    second = tokens(run_to_end(core)["second"])
    assert second == first
    assert core.stats.prefix_hits == (len(prompt) - 1) // 4 * 4 > 0
    assert core.stats.prefix_queries == 2 * len(prompt)
    assert core.pool.usage() == 0.0


def test_lower_priority_value_runs_first(tiny_llama: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    core = make_core(tiny_llama, tokenizer, max_num_seqs=1)
    core.add_request("batch", tokenizer.encode(PROMPTS[0]), greedy(3), seed=1, priority=5)
    core.add_request("interactive", tokenizer.encode(PROMPTS[2]), greedy(3), seed=1, priority=-1)
    core.add_request("normal", tokenizer.encode(PROMPTS[1]), greedy(3), seed=1, priority=0)
    finished = []
    while core.has_work():
        finished += [o.request_id for o in core.step() if o.finish_reason]
    assert finished == ["interactive", "normal", "batch"]


def test_higher_priority_arrival_preempts_a_running_lower_one(
    tiny_llama: Path, tokenizer: PreTrainedTokenizerFast
) -> None:
    expected = alone(tiny_llama, tokenizer, PROMPTS[0], greedy(8))
    core = make_core(tiny_llama, tokenizer, max_num_seqs=1)
    core.add_request("batch", tokenizer.encode(PROMPTS[0]), greedy(8), seed=1, priority=5)
    outputs = [o for _ in range(3) for o in core.step()]
    core.add_request("interactive", tokenizer.encode(PROMPTS[2]), greedy(3), seed=1, priority=-1)
    while core.has_work():
        outputs += core.step()
    finished = [o.request_id for o in outputs if o.finish_reason]
    assert finished == ["interactive", "batch"] and core.stats.num_preemptions == 1
    assert tokens([o for o in outputs if o.request_id == "batch"]) == expected


def test_stop_string_truncates_and_finishes(tiny_llama: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    full = str(tokenizer.decode(alone(tiny_llama, tokenizer, PROMPTS[0], greedy(16))))
    stop = full[5:8]
    assert full.find(stop) == 5
    core = make_core(tiny_llama, tokenizer)
    core.add_request("s", tokenizer.encode(PROMPTS[0]), greedy(16, stop=(stop,)), seed=1)
    outs = run_to_end(core)["s"]
    assert "".join(o.text for o in outs) == full[:5]
    assert outs[-1].finish_reason == "stop" and len(tokens(outs)) < 16


def test_seeded_sampling_is_deterministic_whatever_the_batch(
    tiny_llama: Path, tokenizer: PreTrainedTokenizerFast
) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, ignore_eos=True)
    solo = make_core(tiny_llama, tokenizer)
    solo.add_request("x", tokenizer.encode(PROMPTS[0]), params, seed=7)
    alone_tokens = tokens(run_to_end(solo)["x"])
    shared = make_core(tiny_llama, tokenizer)
    shared.add_request("other", tokenizer.encode(PROMPTS[1]), params, seed=8)
    shared.add_request("x", tokenizer.encode(PROMPTS[0]), params, seed=7)
    outputs = run_to_end(shared)
    assert tokens(outputs["x"]) == alone_tokens
    assert tokens(outputs["other"]) != alone_tokens


def test_logprobs_and_prompt_logprobs_match_transformers(
    tiny_llama: Path, tokenizer: PreTrainedTokenizerFast, hf_model: LlamaForCausalLM
) -> None:
    ids = tokenizer.encode(PROMPTS[1])
    core = make_core(tiny_llama, tokenizer, max_num_batched_tokens=5)  # prompt spans chunks
    core.add_request("lp", ids, greedy(2, logprobs=3, prompt_logprobs=1), seed=1)
    outs = run_to_end(core)["lp"]
    prompt_lps = outs[0].prompt_logprobs
    assert prompt_lps is not None and len(prompt_lps) == len(ids) and prompt_lps[0] is None
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0], -1)
    for pos in range(1, len(ids)):
        lp = prompt_lps[pos]
        assert lp is not None and lp.token_id == ids[pos]
        assert lp.logprob == pytest.approx(float(ref[pos - 1, ids[pos]]), abs=1e-4)
        assert lp.top[0][0] == int(ref[pos - 1].argmax())
    first = outs[0].logprobs[0]
    assert first.token_id == int(ref[-1].argmax()) == first.top[0][0] and len(first.top) == 3


def test_sequences_sharing_cached_prefix_blocks_decode_together(
    tiny_llama: Path, tokenizer: PreTrainedTokenizerFast
) -> None:
    """Later requests reuse the first one's prompt blocks while it is still decoding, so one
    decode step reads the same blocks for several sequences."""
    prompt = tokenizer.encode(PROMPTS[3])
    expected = alone(tiny_llama, tokenizer, PROMPTS[3], greedy(8))
    core = make_core(tiny_llama, tokenizer, block_size=4)
    core.add_request("0", prompt, greedy(8), seed=1)
    first = core.step()
    for name in ("1", "2"):
        core.add_request(name, prompt, greedy(8), seed=1)
    outputs = run_to_end(core)
    outputs["0"] = first + outputs["0"]
    assert core.stats.prefix_hits == 2 * ((len(prompt) - 1) // 4 * 4) > 0
    assert all(tokens(outputs[name]) == expected for name in ("0", "1", "2"))
    assert core.pool.usage() == 0.0
