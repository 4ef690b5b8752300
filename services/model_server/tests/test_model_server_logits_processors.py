"""The batched logits processors against vLLM's per-row definitions, rows of mixed parameters."""

from __future__ import annotations

import torch

from forge_model_server.sample.logits_processors import apply_logits_processors
from forge_model_server.sample.sampler import SamplingParams


def _reference(
    logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int], eos: int
) -> torch.Tensor:
    row = logits.clone()
    if len(output) < p.min_tokens:
        row[eos] = float("-inf")
    for token, bias in p.logit_bias:
        row[token] += bias
    for token in set(prompt) | set(output):
        row[token] = (
            row[token] / p.repetition_penalty if row[token] > 0 else row[token] * p.repetition_penalty
        )
    for token in set(output):
        row[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    return row


def test_each_row_gets_its_own_processors() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 12)
    params = [
        SamplingParams(max_tokens=8),
        SamplingParams(max_tokens=8, presence_penalty=1.5, frequency_penalty=0.5),
        SamplingParams(max_tokens=8, repetition_penalty=1.7, logit_bias=((3, 5.0), (7, -2.0))),
        SamplingParams(max_tokens=8, min_tokens=3, frequency_penalty=-1.0),
    ]
    prompts = [[1, 2], [1, 2, 3], [4, 4, 5], [6]]
    outputs = [[1], [2, 2, 9], [5, 3], [0, 0]]
    got = apply_logits_processors(logits, params, prompts, outputs, [11])
    for i, p in enumerate(params):
        torch.testing.assert_close(got[i], _reference(logits[i], p, prompts[i], outputs[i], 11))
    assert got[3, 11] == float("-inf") and got[0, 11] == logits[0, 11]


def test_no_processor_returns_the_logits_untouched() -> None:
    logits = torch.randn(2, 5)
    params = [SamplingParams(max_tokens=1)] * 2
    assert apply_logits_processors(logits, params, [[1], [2]], [[], [3]], [4]) is logits
