"""Per-request sampling: greedy, temperature, top-k, top-p, and log-probabilities.

Randomness comes only from the request's own ``torch.Generator`` (seeded from the request's ``seed``,
or from the engine's injected RNG), so a seeded request gives the same tokens whatever else shares
its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GREEDY_EPSILON = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks tokens and when it stops; validated before the engine sees it."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 keeps every token."""
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    """How many alternatives to return with each sampled token's log-probability; None for none."""
    prompt_logprobs: int | None = None
    """The same for every prompt token after the first; None for none."""
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already generated (vLLM, OpenAI)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was generated."""
    repetition_penalty: float = 1.0
    """Divides positive (multiplies negative) logits of tokens in the prompt or output; 1 is off."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits before sampling."""
    min_tokens: int = 0
    """Tokens generated before EOS can be sampled or a stop string can end the output."""

    @property
    def processes_logits(self) -> bool:
        """Whether any of the logits processors (:mod:`logits_processors`) applies to this request."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )


@dataclass(frozen=True)
class Logprob:
    """The log-probability of the chosen token and the top alternatives (ids, raw model logits)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def logprob_of(logits: torch.Tensor, token_id: int, top_n: int) -> Logprob:
    """Log-probability of ``token_id`` under the unmodified distribution, as vLLM reports it."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if top_n > 0:
        values, ids = torch.topk(logp, min(top_n, logp.shape[-1]))
        top = tuple((int(i), float(v)) for i, v in zip(ids, values, strict=True))
    return Logprob(token_id, float(logp[token_id]), top)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from a 1-D row of logits."""
    if params.temperature < GREEDY_EPSILON:
        return int(torch.argmax(logits))
    scaled = logits.float() / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # Drop a token when the tokens before it already reach top_p; the first always stays.
        drop = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= params.top_p
        scaled = scaled.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> list[int]:
    """One token per row of ``logits``: the greedy rows in one argmax (one read-back for the whole
    batch), the others each from its own generator."""
    tokens = [0] * len(params)
    greedy = [i for i, p in enumerate(params) if p.temperature < GREEDY_EPSILON]
    if greedy:
        picked = logits if len(greedy) == len(params) else logits[greedy]
        for i, token in zip(greedy, picked.argmax(dim=-1).tolist(), strict=True):
            tokens[i] = int(token)
    for i, p in enumerate(params):
        if p.temperature >= GREEDY_EPSILON:
            tokens[i] = sample(logits[i], p, generators[i])
    return tokens
