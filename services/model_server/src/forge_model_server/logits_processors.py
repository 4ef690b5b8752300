"""vLLM's logits processors, batched: ``min_tokens``, ``logit_bias`` and the presence, frequency
and repetition penalties, applied to one step's rows of logits before sampling.

Every processor is a few tensor operations over the rows that use it: per-row parameters become
column vectors, token counts come from one ``scatter_add`` over the padded output ids, and the
prompt's tokens from one ``scatter`` over the padded prompt ids. The order is vLLM's:
``min_tokens`` (EOS masked), ``logit_bias``, then the repetition penalty (prompt and output
tokens), the frequency and the presence penalties (output tokens). Logprobs are reported from the
raw logits, as vLLM reports them by default.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from forge_model_server.sampling import SamplingParams


def _padded(rows: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    """``rows`` as one [len(rows), longest] tensor, short rows filled with ``pad``."""
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), pad, dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out.to(device)


def _penalise(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """The three penalties on ``logits`` (the rows that use one), vectorised."""
    rows, vocab = logits.shape
    device, dtype = logits.device, logits.dtype
    repetition = torch.tensor([p.repetition_penalty for p in params], dtype=dtype, device=device)[:, None]
    frequency = torch.tensor([p.frequency_penalty for p in params], dtype=dtype, device=device)[:, None]
    presence = torch.tensor([p.presence_penalty for p in params], dtype=dtype, device=device)[:, None]
    # One extra column takes the padding.
    padded = _padded(output_ids, vocab, device)
    counts = torch.zeros(rows, vocab + 1, dtype=dtype, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=dtype))
    counts = counts[:, :vocab]
    generated = counts > 0
    if any(p.repetition_penalty != 1.0 for p in params):
        in_prompt = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=device)
        in_prompt.scatter_(1, _padded(prompt_ids, vocab, device), True)
        seen = in_prompt[:, :vocab] | generated
        penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalised, logits)
    return logits - frequency * counts - presence * generated.to(dtype)


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
