"""vLLM's logits processors, batched: ``min_tokens``, ``logit_bias`` and the presence, frequency
and repetition penalties, applied to one step's rows of logits before sampling.

Every processor is a few tensor operations over the rows that use it: per-row parameters become
vectors, and the penalties touch only the (row, token) pairs that occur, found and counted by one
``unique`` over flat keys. The order is vLLM's:
``min_tokens`` (EOS masked), ``logit_bias``, then the repetition penalty (prompt and output
tokens), the frequency and the presence penalties (output tokens). Logprobs are reported from the
raw logits, as vLLM reports them by default.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from forge_model_server.sample.sampler import SamplingParams


def _pairs(ids: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """Each (row, token) of ``ids`` as one flat key ``row * vocab + token``."""
    flat = [i * vocab + t for i, row in enumerate(ids) for t in row]
    return torch.tensor(flat, dtype=torch.long, device=device)


def _penalise(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """The three penalties on ``logits`` (the rows that use one), touching only the (row, token)
    pairs that occur: the work grows with the tokens seen, not with the vocabulary."""
    vocab = logits.shape[1]
    device, dtype = logits.device, logits.dtype
    repetition = torch.tensor([p.repetition_penalty for p in params], dtype=dtype, device=device)
    frequency = torch.tensor([p.frequency_penalty for p in params], dtype=dtype, device=device)
    presence = torch.tensor([p.presence_penalty for p in params], dtype=dtype, device=device)
    generated, counts = torch.unique(_pairs(output_ids, vocab, device), return_counts=True)
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = torch.unique(torch.cat([generated, _pairs(prompt_ids, vocab, device)]))
        rows, tokens = seen // vocab, seen % vocab
        values, penalty = logits[rows, tokens], repetition[rows]
        logits[rows, tokens] = torch.where(values > 0, values / penalty, values * penalty)
    rows, tokens = generated // vocab, generated % vocab
    logits[rows, tokens] -= frequency[rows] * counts.to(dtype) + presence[rows]
    return logits


def apply_logits_processors(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    eos_token_ids: Sequence[int],
) -> torch.Tensor:
    """``logits`` ([rows, vocab]) with each row's processors applied; the input when none applies.

    ``output_ids`` are the tokens each row has generated so far (not counting the one being
    sampled); ``prompt_ids`` its prompt.
    """
    if not any(p.processes_logits for p in params):
        return logits
    vocab = logits.shape[1]
    device = logits.device
    out = logits.float().clone()
    # 1. min_tokens: no EOS before the minimum.
    short = [i for i, (p, o) in enumerate(zip(params, output_ids, strict=True)) if len(o) < p.min_tokens]
    eos = [t for t in eos_token_ids if 0 <= t < vocab]
    if short and eos:
        rows = torch.tensor(short, dtype=torch.long, device=device)
        cols = torch.tensor(eos, dtype=torch.long, device=device)
        out[rows[:, None], cols[None, :]] = float("-inf")
    # 2. logit_bias.
    biased = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias if 0 <= t < vocab]
    if biased:
        index = torch.tensor([(i, t) for i, t, _ in biased], dtype=torch.long, device=device)
        bias = torch.tensor([b for _, _, b in biased], dtype=out.dtype, device=device)
        out.index_put_((index[:, 0], index[:, 1]), bias, accumulate=True)
    # 3. Penalties, on the rows that have one.
    penalised = [
        i
        for i, p in enumerate(params)
        if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty
    ]
    if penalised:
        rows = torch.tensor(penalised, dtype=torch.long, device=device)
        out[rows] = _penalise(
            out[rows],
            [params[i] for i in penalised],
            [prompt_ids[i] for i in penalised],
            [output_ids[i] for i in penalised],
        )
    return out
