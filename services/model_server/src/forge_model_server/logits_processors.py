"""vLLM's logits processors, batched: ``min_tokens``, ``logit_bias`` and the presence, frequency
and repetition penalties, applied to one step's rows of logits before sampling.

Every processor is one tensor operation over the whole batch: per-row parameters become column
vectors (neutral values for rows that do not use them), token counts come from one
``scatter_add`` over the padded output ids, and the prompt's tokens from one ``scatter`` over the
padded prompt ids. The order is vLLM's: ``min_tokens`` (EOS masked), ``logit_bias``, then the
repetition penalty (prompt and output tokens), the frequency and the presence penalties (output
tokens). Logprobs are reported from the raw logits, as vLLM reports them by default.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from forge_model_server.sampling import SamplingParams


def _padded(rows: Sequence[Sequence[int]], pad: int) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), pad, dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out


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
    rows, vocab = logits.shape
    out = logits.float().clone()
    # 1. min_tokens: no EOS before the minimum.
    if eos_token_ids and any(p.min_tokens for p in params):
        short = torch.tensor([len(o) < p.min_tokens for p, o in zip(params, output_ids, strict=True)])
        eos = torch.tensor([t for t in eos_token_ids if 0 <= t < vocab], dtype=torch.long)
        if eos.numel():
            block = torch.zeros(rows, vocab, dtype=torch.bool)
            block[:, eos] = True
            out = out.masked_fill(block & short[:, None], float("-inf"))
    # 2. logit_bias.
    biased = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias if 0 <= t < vocab]
    if biased:
        index = torch.tensor([(i, t) for i, t, _ in biased], dtype=torch.long)
        bias = torch.tensor([b for _, _, b in biased], dtype=out.dtype)
        out.index_put_((index[:, 0], index[:, 1]), bias, accumulate=True)
    # 3. Penalties, over the token counts of each row (one extra column catches the padding).
    repetition = torch.tensor([p.repetition_penalty for p in params], dtype=out.dtype)[:, None]
    frequency = torch.tensor([p.frequency_penalty for p in params], dtype=out.dtype)[:, None]
    presence = torch.tensor([p.presence_penalty for p in params], dtype=out.dtype)[:, None]
    if bool((repetition != 1.0).any() or frequency.any() or presence.any()):
        padded = _padded(output_ids, vocab)
        counts = torch.zeros(rows, vocab + 1, dtype=out.dtype)
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=out.dtype))
        counts = counts[:, :vocab]
        generated = counts > 0
        if bool((repetition != 1.0).any()):
            in_prompt = torch.zeros(rows, vocab + 1, dtype=torch.bool)
            in_prompt.scatter_(1, _padded(prompt_ids, vocab), True)
            seen = in_prompt[:, :vocab] | generated
            penalised = torch.where(out > 0, out / repetition, out * repetition)
            out = torch.where(seen, penalised, out)
        out = out - frequency * counts - presence * generated.to(out.dtype)
    return out
