"""Pass rates and the band filter: inclusive bounds, the histogram, an empty band's error with the
histogram; the local HF student samples in batches, reproducibly from its seed."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from forge_training.data import EOT, train_tokenizer
from forge_training.export import export_hf
from forge_training.synthetic import difficulty
from forge_training.synthetic.problems import Problem, Solution
from forge_training.synthetic.student import HFStudent
from forge_training.synthetic.verify import Verified


def item(i: int, answer: str = "5") -> Verified:
    p = Problem(
        f"p{i}", "add_sub", "arithmetic", "train", 1, f"Question {i}?", (Solution(f"#### {answer}"),), answer
    )
    return Verified(p, answer, p.solutions, ("ok",))


class ScriptedStudent:
    """Answers question i right in the first ``right[i]`` of its n samples."""

    name = "scripted"

    def __init__(self, right: dict[str, int]) -> None:
        self.right = right

    def sample(
        self, prompts: Sequence[str], n: int, *, temperature: float, max_new_tokens: int, seed: int
    ) -> list[list[str]]:
        out = []
        for prompt in prompts:
            key = prompt.split("User: ")[1].split("\n")[0]
            good = self.right[key]
            out.append([" 2+3 = 5.\n#### 5" if j < good else " #### 4" for j in range(n)])
        return out


def test_pass_rates_band_and_histogram() -> None:
    items = [item(i) for i in range(6)]
    right = {f"Question {i}?": r for i, r in enumerate([0, 1, 2, 5, 8, 10])}
    rates = difficulty.pass_rates(ScriptedStudent(right), items, 10, chunk=4)
    assert rates == [0.0, 0.1, 0.2, 0.5, 0.8, 1.0]
    band = difficulty.band_filter(items, rates, 0.2, 0.8)  # bounds inclusive
    assert [v.problem.id for v in band.kept] == ["p2", "p3", "p4"]
    assert (band.below, band.above) == (2, 1)
    assert band.histogram["0.0-0.1"] == 1 and band.histogram["0.9-1.0"] == 1
    assert sum(band.histogram.values()) == 6
    assert [v.problem.id for v in difficulty.band_filter(items, rates, 0.5, 0.5).kept] == ["p3"]


def test_empty_band_raises_with_the_histogram() -> None:
    items = [item(i) for i in range(3)]
    with pytest.raises(difficulty.EmptyBandError, match="histogram") as err:
        difficulty.band_filter(items, [0.0, 0.0, 1.0], 0.2, 0.8)
    assert err.value.histogram["0.0-0.1"] == 2 and err.value.histogram["0.9-1.0"] == 1


@pytest.mark.parametrize(("lo", "hi"), [(-0.1, 0.5), (0.6, 0.5), (0.2, 1.5)])
def test_bad_bounds_are_refused(lo: float, hi: float) -> None:
    with pytest.raises(ValueError, match="band"):
        difficulty.band_filter([item(0)], [0.5], lo, hi)


def test_hf_student_samples_in_batches_reproducibly(tmp_path: Path) -> None:
    tok = train_tokenizer("User: what is 2+3?\nAssistant: 2+3 = 5.\n#### 5\n" * 20, 300)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    export_hf(LlamaForCausalLM(config), tok, tmp_path)
    student = HFStudent(tmp_path, batch_size=4)
    prompts = [difficulty.prompt_of("what is 2+3?"), difficulty.prompt_of("what is 20+30 and more?")]
    a = student.sample(prompts, 3, temperature=1.0, max_new_tokens=6, seed=1)
    b = student.sample(prompts, 3, temperature=1.0, max_new_tokens=6, seed=1)
    assert a == b and [len(x) for x in a] == [3, 3]
    greedy = student.sample(prompts, 2, temperature=0.0, max_new_tokens=6, seed=9)
    assert greedy[0][0] == greedy[0][1]


def _tiny_student(tmp_path: Path, batch_size: int) -> HFStudent:
    tok = train_tokenizer("User: what is 2+3?\nAssistant: 2+3 = 5.\n#### 5\n" * 20, 300)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(40)  # a peaked next-token distribution, so that sampling is testable
    export_hf(model, tok, tmp_path)
    return HFStudent(tmp_path, batch_size=batch_size)


def test_hf_student_greedy_matches_transformers_generate(tmp_path: Path) -> None:
    """The cached decoding loop gives Hugging Face ``generate``'s greedy completions, rows of
    different prompt lengths and rows stopping at end-of-text included."""
    student = _tiny_student(tmp_path, batch_size=6)
    prompts = [difficulty.prompt_of(q) for q in ("what is 2+3?", "2+3", "what is 20+30 and more? what", "5")]
    ours = student.sample(prompts, 2, temperature=0.0, max_new_tokens=12, seed=3)
    eot = student.tokenizer.convert_tokens_to_ids(EOT)
    batch = student.tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = student.model.generate(
            **batch, do_sample=False, max_new_tokens=12, eos_token_id=eot, pad_token_id=eot
        )
    reference = student.tokenizer.batch_decode(out[:, batch["input_ids"].size(1) :], skip_special_tokens=True)
    assert [c[0] for c in ours] == reference and [c[1] for c in ours] == reference


def test_hf_student_samples_from_the_softmax(tmp_path: Path) -> None:
    """First tokens sampled at temperature 1 (and 0.5) follow the model's softmax (at that temperature)."""
    student = _tiny_student(tmp_path, batch_size=4000)
    prompt = difficulty.prompt_of("what is 2+3?")
    ids = student.tokenizer([prompt], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = student.model(input_ids=ids).logits[0, -1].float()
    eot = student.tokenizer.convert_tokens_to_ids(EOT)
    for temperature in (1.0, 0.5):
        probs = torch.softmax(logits / temperature, dim=-1)
        rows = student._decode([prompt], 4000, temperature, 1, 7, 0, eot)
        counts = torch.zeros_like(probs)
        for r in rows:
            counts[r[0] if r else eot] += 1
        assert float((counts / 4000 - probs).abs().max()) < 0.03
        assert float(probs.max()) > 0.1  # the check has something to see


def test_hf_student_other_architectures_sample_through_generate(tmp_path: Path) -> None:
    tok = train_tokenizer("User: what is 2+3?\nAssistant: 2+3 = 5.\n#### 5\n" * 20, 300)
    config = GPT2Config(vocab_size=tok.get_vocab_size(), n_embd=16, n_layer=1, n_head=2, n_positions=64)
    export_hf(GPT2LMHeadModel(config), tok, tmp_path)
    student = HFStudent(tmp_path, batch_size=4)
    assert student.model.config.model_type == "gpt2"
    prompts = [difficulty.prompt_of("what is 2+3?"), difficulty.prompt_of("what is 20+30 and more?")]
    a = student.sample(prompts, 3, temperature=1.0, max_new_tokens=6, seed=1)
    assert a == student.sample(prompts, 3, temperature=1.0, max_new_tokens=6, seed=1)
    assert [len(x) for x in a] == [3, 3]
    greedy = student.sample(prompts, 2, temperature=0.0, max_new_tokens=6, seed=9)
    assert greedy[0][0] == greedy[0][1]
