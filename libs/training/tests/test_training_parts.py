"""Training runtime parts with no training run: the mixture sampler, loader prefetch, the
Young/Daly interval, the MFU formula, the chat template and the SFT loss mask, the Wilson
interval, the benchmark's step-time calibration, and recipes that refuse bad input with the field named."""

from __future__ import annotations

import json
import math
import re
import threading
import time
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from forge_kit.paths import resolve_data_path
from forge_training import parallel, recipes, schema, validation
from forge_training.bench.train import steady_step_s
from forge_training.checkpoint import optimal_interval_s
from forge_training.data import EOT, MixtureSampler, train_tokenizer
from forge_training.export import hf_tokenizer
from forge_training.mfu import matmul_params, peak_flops, train_flops_per_token
from forge_training.objectives.pairwise import pad_rows
from forge_training.pairs import (
    CHAT_TEMPLATE,
    Encoded,
    encode_pairs,
    fit,
    load_pairs,
    parse_transcript,
    render,
    to_pair,
)
from forge_training.prefetch import Prefetcher
from forge_training.schema import MetricsConfig, PairsConfig, RecipeError
from forge_training.train import TrainResult

HH_ROW = {
    "chosen": "\n\nHuman: Can you name a bird?\n\nAssistant: Which kind?\n\nHuman: Any.\n\nAssistant: A robin.",
    "rejected": "\n\nHuman: Can you name a bird?\n\nAssistant: Which kind?\n\nHuman: Any.\n\nAssistant: No.",
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    text = resolve_data_path(schema.DEFAULT_CORPUS).read_text(encoding="utf-8")[:20_000]
    return train_tokenizer(text + "User: Assistant: robin bird", 300)


# -- continual pre-training mixture -------------------------------------------------------------


def test_mixture_honours_the_sampling_weight_and_resumes_exactly_for_any_world_size() -> None:
    sampler = MixtureSampler([100, 50], [0.85, 0.15], global_batch=8, seed=5)
    steps = [sampler.next_step(0, 1) for _ in range(500)]
    general = sum(source == 1 for step in steps for source, _ in step) / (500 * 8)
    assert abs(general - 0.15) < 0.02  # sd 0.0056 over 4000 draws
    # Each source walks a permutation: its first 50 draws are 50 distinct windows.
    first_general = [w for step in steps for s, w in step if s == 1][:50]
    assert sorted(first_general) == list(range(50))
    # Two ranks read the two halves of the same global batch; state is a global position.
    ranks = [MixtureSampler([100, 50], [0.85, 0.15], 8, 5) for _ in range(2)]
    for expected in steps[:20]:
        assert ranks[0].next_step(0, 2) + ranks[1].next_step(1, 2) == expected
    resumed = MixtureSampler([100, 50], [0.85, 0.15], 8, 5)
    resumed.load_state_dict(ranks[0].state_dict())
    assert [resumed.next_step(0, 1) for _ in range(30)] == steps[20:50]


def test_mixture_fraction_follows_the_configured_weight() -> None:
    for fraction in (0.05, 0.2):
        sampler = MixtureSampler([200, 200], [1 - fraction, fraction], global_batch=10, seed=1)
        draws = [s for _ in range(600) for s, _ in sampler.next_step(0, 1)]
        assert abs(sum(draws) / len(draws) - fraction) < 0.02


# -- prefetch -----------------------------------------------------------------------------------


def test_prefetch_reads_ahead_in_order_and_stops_cleanly() -> None:
    made: list[int] = []
    lock = threading.Lock()

    def produce() -> int:
        with lock:
            made.append(len(made))
            return made[-1]

    prefetch = Prefetcher(produce, count=10, depth=3)
    assert prefetch.next() == 0
    deadline = time.monotonic() + 30
    while len(made) < 4 and time.monotonic() < deadline:  # one handed out, three ready
        time.sleep(0.01)
    assert len(made) == 4
    assert [prefetch.next() for _ in range(3)] == [1, 2, 3]
    prefetch.close()
    assert len(made) <= 8  # stopped without drawing everything


def test_prefetch_hands_a_producer_failure_to_the_consumer() -> None:
    def broken() -> int:
        raise OSError("shard unreadable")

    prefetch = Prefetcher(broken, count=2, depth=2)
    with pytest.raises(OSError, match="shard unreadable"):
        prefetch.next()
    prefetch.close()


# -- checkpoint interval ------------------------------------------------------------------------


def test_young_and_daly_intervals() -> None:
    # Young: sqrt(2 * 10 s * 3600 s) = 268.33 s.
    assert optimal_interval_s("young", 10.0, 3600.0) == pytest.approx(268.328, abs=1e-3)
    # Daly: 268.328 * (1 + sqrt(10/7200)/3 + (10/7200)/9) - 10 = 268.328 * 1.012577 - 10 = 261.70 s.
    assert optimal_interval_s("daly", 10.0, 3600.0) == pytest.approx(261.703, abs=1e-3)
    # Daly is below Young by about the save time for short saves, and is M once d >= 2M.
    assert optimal_interval_s("daly", 1.0, 1e6) == pytest.approx(math.sqrt(2e6) - 1.0 + 1 / 3, rel=1e-4)
    assert optimal_interval_s("daly", 50.0, 20.0) == 20.0
    with pytest.raises(ValueError):
        optimal_interval_s("young", 1.0, 0.0)


# -- MFU ----------------------------------------------------------------------------------------


def test_flops_per_token_counts_projections_mlp_head_and_attention() -> None:
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    # per layer: q 128x128 + k,v 2x(128x64) + o 128x128 = 49,152; mlp 3x128x344 = 132,096.
    assert matmul_params(cfg, 512) == 4 * (49_152 + 132_096) + 128 * 512
    assert train_flops_per_token(cfg, 512, 64) == 6 * (4 * 181_248 + 65_536) + 12 * 4 * 128 * 64
    import torch

    assert peak_flops(MetricsConfig(peak_flops=5e12), torch.device("cpu")) == 5e12
    torch.set_num_threads(1)
    assert peak_flops(MetricsConfig(cpu_peak_flops_per_thread=2e10), torch.device("cpu")) == 2e10


# -- prompt/response data -----------------------------------------------------------------------


def test_hh_transcripts_split_into_prompt_and_response_and_bad_pairs_are_dropped() -> None:
    assert parse_transcript(HH_ROW["chosen"])[-1] == ("assistant", "A robin.")
    pair = to_pair(HH_ROW)
    assert pair is not None and pair.chosen == "A robin." and pair.rejected == "No."
    assert [m["role"] for m in pair.messages()] == ["user", "assistant", "user"]
    assert to_pair({"chosen": HH_ROW["chosen"], "rejected": HH_ROW["chosen"]}) is None  # identical
    other_prefix = HH_ROW["rejected"].replace("Any.", "A big one.")
    assert to_pair({"chosen": HH_ROW["chosen"], "rejected": other_prefix}) is None  # prompts differ
    train, val = load_pairs(PairsConfig(max_pairs=50), seed=3, val_fraction=0.1)
    assert (len(train), len(val)) == (45, 5) and not set(train) & set(val)


def test_sft_mask_covers_exactly_the_response_tokens(tokenizer: Tokenizer) -> None:
    pair = to_pair(HH_ROW)
    assert pair is not None
    ((chosen,),) = encode_pairs(tokenizer, [pair], 256, end_of_text=True, chosen_only=True)
    short = Encoded((1, 2, 3), 2)
    micro = pad_rows([chosen, short], pad_id=tokenizer.token_to_id(EOT), mask_prompt=True)
    labels, ids = micro["labels"][0], micro["input_ids"][0]
    trained = [int(t) for t in labels if t != -100]
    assert tokenizer.decode(trained, skip_special_tokens=False) == " A robin." + EOT
    prompt = [int(t) for t, lab in zip(ids, labels, strict=True) if lab == -100][: chosen.prompt_len]
    assert tokenizer.decode(prompt, skip_special_tokens=False) == render(
        pair.messages(), add_generation_prompt=True
    )
    assert (labels != -100).sum() == len(chosen.ids) - chosen.prompt_len
    # Padding is masked and not attended to; the short row trains on its one response token.
    assert micro["labels"][1].tolist() == [-100, -100, 3] + [-100] * (len(chosen.ids) - 3)
    assert micro["attention_mask"][1].sum() == 3


def test_long_prompts_are_cut_from_the_left_and_responses_keep_at_least_half(tokenizer: Tokenizer) -> None:
    pair = to_pair(HH_ROW)
    assert pair is not None
    ((chosen, rejected),) = encode_pairs(tokenizer, [pair], 12, end_of_text=False)
    assert len(chosen.ids) <= 12 and len(rejected.ids) <= 12
    assert chosen.ids[: chosen.prompt_len] == rejected.ids[: rejected.prompt_len]  # one shared prompt cut
    full = tokenizer.encode(render(pair.messages(), add_generation_prompt=True)).ids
    assert list(chosen.ids[: chosen.prompt_len]) == full[-chosen.prompt_len :]


def test_the_exported_chat_template_renders_like_the_training_data(tokenizer: Tokenizer) -> None:
    pair = to_pair(HH_ROW)
    assert pair is not None
    hf = hf_tokenizer(tokenizer, CHAT_TEMPLATE)
    messages = pair.messages()
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == render(
        messages, True
    )
    full = [*messages, {"role": "assistant", "content": pair.chosen}]
    assert hf.apply_chat_template(full, tokenize=False) == render(full)


# -- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("recipe", "overrides", "message"),
    [
        ("dpo_hh", {"dpo.betta": "1"}, "unknown recipe key 'dpo.betta'"),
        ("sft_hh", {"dpo.beta": "0.2"}, "dpo.beta: not used by the 'sft' task"),
        ("reward_hh", {"model.hidden_size": "64"}, "model.hidden_size: not used by the 'reward' task"),
        (
            "smoke",
            {"mixture.general_fraction": "0.2"},
            "mixture.general_fraction: not used by the 'pretrain'",
        ),
        ("cpt_scifact", {"data.vocab_size": "600"}, "data.vocab_size: not used by the 'cpt' task"),
    ],
)
def test_unknown_and_inapplicable_keys_are_refused(
    recipe: str, overrides: dict[str, str], message: str
) -> None:
    with pytest.raises(RecipeError, match=re.escape(message)):
        recipes.build(recipe, overrides)


@pytest.mark.parametrize(
    ("recipe", "overrides", "message"),
    [
        ("sft_hh", {}, "init.parent: the 'sft' task starts from a parent checkpoint"),
        ("dpo_hh", {"init.parent": "/nonexistent/hf"}, "init.parent: '/nonexistent/hf' does not exist"),
        (
            "reward_hh",
            {"init.parent": "/nonexistent/checkpoints/r/step-00000001/manifest.json"},
            "init.parent: '/nonexistent/checkpoints/r/step-00000001/manifest.json' does not exist",
        ),
        ("sft_hh", {"pairs.path": "/nonexistent/pairs"}, "pairs.path: '/nonexistent/pairs' does not exist"),
        ("cpt_scifact", {"mixture.general_fraction": "1.5"}, "mixture.general_fraction: must be in (0, 1)"),
        (
            "cpt_scifact",
            {"mixture.general_corpus": "/nonexistent.txt"},
            "mixture.general_corpus: '/nonexistent.txt'",
        ),
        ("smoke", {"checkpoint.interval_policy": "young"}, "checkpoint.mtbf_s: must be positive"),
        ("smoke", {"checkpoint.interval_policy": "often"}, "checkpoint.interval_policy: must be one of"),
        ("smoke", {"data.prefetch_batches": "-1"}, "data.prefetch_batches"),
    ],
)
def test_missing_inputs_are_refused_before_training(
    recipe: str, overrides: dict[str, str], message: str
) -> None:
    config = recipes.build(recipe, overrides)
    with pytest.raises(RecipeError, match=re.escape(message)):
        validation.validate(config, 1)


def test_a_corrupt_hugging_face_parent_is_refused(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(
        LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=2)
    )  # fmt: skip
    model.save_pretrained(tmp_path / "hf")
    config = recipes.build("sft_hh", {"init.parent": str(tmp_path / "hf")})
    with pytest.raises(RecipeError, match=r"init\.parent: .*tokenizer\.json: missing"):
        validation.validate(config, 1)
    weights = tmp_path / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # a torn copy
    with pytest.raises(RecipeError, match=r"init\.parent: .*model\.safetensors: corrupt weights"):
        validation.validate(config, 1)


def _params_with_grads(*grads: list[float]) -> list[torch.nn.Parameter]:
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros(len(g)))
        p.grad = torch.tensor(g)
        params.append(p)
    return params


def test_clipping_scales_first_then_clips_the_scaled_norm_in_one_factor() -> None:
    """The loop hands the 1 / global-units factor to the clipping pass: the norm it reports and
    clips is that of the scaled gradients, exactly as scaling first and clipping with torch."""
    grads = ([3.0, 4.0], [12.0])  # norm 13
    ours, theirs = _params_with_grads(*grads), _params_with_grads(*grads)
    norm = parallel.clip_grad_norm(ours, max_norm=1.0, scale=0.5)
    for p in theirs:
        assert p.grad is not None
        p.grad.mul_(0.5)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert norm == pytest.approx(float(expected)) == pytest.approx(6.5)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.allclose(a.grad, b.grad)  # type: ignore[arg-type]
    # Under the limit only the scale applies; max_norm 0 means no clipping at all.
    small = _params_with_grads([0.3, 0.4])
    assert parallel.clip_grad_norm(small, max_norm=1.0, scale=2.0) == pytest.approx(1.0)
    assert small[0].grad is not None and torch.allclose(small[0].grad, torch.tensor([0.6, 0.8]), atol=1e-5)
    unclipped = _params_with_grads([30.0, 40.0])
    assert parallel.clip_grad_norm(unclipped, max_norm=0.0, scale=0.1) == pytest.approx(5.0)
    assert unclipped[0].grad is not None and torch.allclose(unclipped[0].grad, torch.tensor([3.0, 4.0]))


def test_the_benchmark_calibrates_on_the_probes_last_window_not_its_first_steps(tmp_path: Path) -> None:
    # 20 steps of 768 tokens in 2.4 s: steps 1-10 took 1.4 s (first calls), steps 11-20 took 1.0 s.
    probe = TrainResult(outcome="succeeded", step=20, wall_s=2.4, tokens_per_s=20 * 768 / 2.4)
    metrics = tmp_path / "metrics.jsonl"
    lines = [
        {"step": 0, "val_loss": 6.2},
        {"step": 10, "tokens_per_s": 7680 / 1.4},
        {"step": 20, "tokens_per_s": 7680 / 1.0},
    ]
    metrics.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert steady_step_s(metrics, probe) == pytest.approx(0.1)
    metrics.write_text(json.dumps({"step": 0, "val_loss": 6.2}) + "\n")  # no window logged
    assert steady_step_s(metrics, probe) == pytest.approx(0.12)


@pytest.mark.parametrize("max_len", range(0, 13))
def test_the_pairwise_cut_never_exceeds_max_len_and_keeps_the_latest_prompt_tokens(max_len: int) -> None:
    """The one truncation rule of training and of ``forge rm eval``: prompt + each response fits
    in ``max_len`` (no room left means no prompt at all, not the whole of it), the prompt loses
    its oldest tokens first, a response its end."""
    prompt, responses = [1, 2, 3, 4, 5, 6], [[10, 11, 12, 13], [20, 21]]
    cut, kept = fit(prompt, responses, max_len)
    assert all(len(cut) + len(r) <= max_len for r in kept)
    assert cut == prompt[len(prompt) - len(cut) :]
    assert all(r == whole[: len(r)] for r, whole in zip(kept, responses, strict=True))
    if max_len == 0:
        assert (cut, kept) == ([], [[], []])
