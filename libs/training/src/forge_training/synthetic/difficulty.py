"""Difficulty filtering: a student's pass rate on each problem, and the band of problems it solves
some but not all of the time (STaR / ReST-EM practice: keep pass rates in [0.2, 0.8]).

The student answers through the :class:`Student` protocol: ``sample(prompts, n)`` returns ``n``
completions per prompt. :class:`HFStudent` is the local implementation on a Forge export or any
Hugging Face causal LM directory (torch, batched sampling with left padding, seeded); the
synthetic-data workflow adds one that samples through the platform. A completion passes when its
``####`` answer matches the verified answer (:func:`forge_training.synthetic.verify.grade`).

:func:`band_filter` keeps problems with ``lo <= pass rate <= hi`` and reports the histogram of
pass rates; an empty band raises :class:`EmptyBandError` carrying that histogram.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from forge_training.data import EOT
from forge_training.pairs import render
from forge_training.synthetic.verify import Verified, grade

HISTOGRAM_BINS = 10


class Student(Protocol):
    """The model being taught. Called by :func:`pass_rates` (and the workflow's difficulty
    activity) with a batch of prompts; returns ``n`` completions per prompt, in prompt order."""

    @property
    def name(self) -> str:
        """What the lineage records as the student."""

    def sample(
        self, prompts: Sequence[str], n: int, *, temperature: float, max_new_tokens: int, seed: int
    ) -> list[list[str]]: ...


def prompt_of(question: str) -> str:
    """The chat-template prompt the ``sft`` task trains on: ``User: …\\nAssistant:``."""
    return render([{"role": "user", "content": question}], add_generation_prompt=True)


class HFStudent:
    """A local causal LM: prompts left-padded into batches of about ``batch_size`` rows (prompts x
    n), cut from the left to ``max_prompt_tokens``, sampled at ``temperature`` (greedy at 0), each
    row stopped at end-of-text, one seed per batch: Llama-architecture models (Forge exports) by a
    key/value-cached loop (:meth:`sample`), other architectures by Hugging Face ``generate``."""

    def __init__(
        self, path: Path, *, batch_size: int = 256, max_prompt_tokens: int = 512, threads: int | None = None
    ) -> None:
        self.name = str(path)
        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
        self.tokenizer.padding_side = "left"
        self.tokenizer.truncation_side = "left"  # a long prompt keeps its end (the question's ask)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = EOT
        self.model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
        self.max_prompt_tokens = max_prompt_tokens
        self.batch_size = batch_size
        if threads:
            torch.set_num_threads(threads)

    @torch.no_grad()
    def sample(
        self, prompts: Sequence[str], n: int, *, temperature: float, max_new_tokens: int, seed: int
    ) -> list[list[str]]:
        """``n`` completions per prompt: batches of ``batch_size // n`` prompts (at least one), each
        prompt read once and its key/value cache repeated ``n`` times, then one token per step for
        every unfinished row (rows leave the batch at end-of-text), sampled from the softmax at
        ``temperature`` (argmax at 0) with a generator seeded per batch."""
        if n < 1:
            raise ValueError(f"n must be at least 1, got {n}")
        eot = self.tokenizer.convert_tokens_to_ids(EOT)
        if getattr(self.model.config, "model_type", None) != "llama":
            return self._generate(prompts, n, temperature, max_new_tokens, seed, eot)
        per_batch = max(1, self.batch_size // n)
        texts: list[str] = []
        for b, start in enumerate(range(0, len(prompts), per_batch)):
            ids = self._decode(
                list(prompts[start : start + per_batch]), n, temperature, max_new_tokens, seed, b, eot
            )
            texts += self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        return [texts[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _generate(
        self, prompts: Sequence[str], n: int, temperature: float, max_new_tokens: int, seed: int, eot: int
    ) -> list[list[str]]:
        """Other architectures: Hugging Face ``generate`` on batches of ``batch_size`` rows."""
        rows = [p for p in prompts for _ in range(n)]
        texts: list[str] = []
        for b, start in enumerate(range(0, len(rows), self.batch_size)):
            batch = self.tokenizer(
                rows[start : start + self.batch_size],
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=self.max_prompt_tokens,
            )
            torch.manual_seed(seed * 1_000_003 + b)
            out = self.model.generate(
                **batch,
                do_sample=temperature > 0,
                temperature=temperature if temperature > 0 else None,
                top_k=0 if temperature > 0 else None,
                top_p=None,
                max_new_tokens=max_new_tokens,
                eos_token_id=eot,
                pad_token_id=eot,
            )
            texts += self.tokenizer.batch_decode(
                out[:, batch["input_ids"].size(1) :], skip_special_tokens=True
            )
        return [texts[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _decode(
        self, prompts: list[str], n: int, temperature: float, max_new_tokens: int, seed: int, b: int, eot: int
    ) -> list[list[int]]:
        """Token ids of ``n`` completions of each prompt (prompt-major), without the end-of-text."""
        batch = self.tokenizer(
            prompts, return_tensors="pt", padding=True, truncation=True, max_length=self.max_prompt_tokens
        )
        mask = batch["attention_mask"]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(
            input_ids=batch["input_ids"], attention_mask=mask, position_ids=positions, use_cache=True
        )
        logits = out.logits[:, -1, :].float()
        step_fn = _LlamaSteps(self.model, out.past_key_values, mask, n, max_new_tokens)
        position = positions[:, -1:].repeat_interleave(n, dim=0) + 1
        if n > 1:
            logits = logits.repeat_interleave(n, dim=0)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + b)
        rows = torch.arange(logits.size(0))  # the original row of each live row
        tokens: list[list[int]] = [[] for _ in range(logits.size(0))]
        for step in range(max_new_tokens):
            if temperature > 0:
                probs = torch.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            else:
                nxt = logits.argmax(dim=-1)
            live = nxt != eot
            for r, t, keep in zip(rows.tolist(), nxt.tolist(), live.tolist(), strict=True):
                if keep:
                    tokens[r].append(t)
            if step == max_new_tokens - 1 or not bool(live.any()):
                break
            if not bool(live.all()):
                keep_idx = live.nonzero().squeeze(1)
                rows, nxt, position = rows[keep_idx], nxt[keep_idx], position[keep_idx]
                step_fn.keep(keep_idx)
            logits = step_fn(nxt, position)
            position = position + 1
        return tokens


class _LlamaSteps:
    """One-token decoding steps of a Llama-architecture model on preallocated key/value buffers
    (the prompt's cache, repeated ``n`` times per prompt, then ``max_new_tokens`` free columns):
    the model's own projections, norms, rotary embedding and MLP, attention by
    ``scaled_dot_product_attention`` over the filled columns with the prompts' padding masked.
    Finished rows are dropped from the buffers (:meth:`keep`)."""

    def __init__(self, model: Any, cache: Any, mask: torch.Tensor, n: int, max_new_tokens: int) -> None:
        self.model = model
        self.inner = model.model
        width = mask.size(1) + max_new_tokens
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        for layer in cache.layers:
            for src, dst in ((layer.keys, self.keys), (layer.values, self.values)):
                buf = src.new_zeros((src.size(0) * n, src.size(1), width, src.size(3)))
                buf[:, :, : src.size(2)] = src.repeat_interleave(n, dim=0)
                dst.append(buf)
        self.mask = torch.zeros((mask.size(0) * n, 1, 1, width), dtype=torch.bool)
        self.mask[:, 0, 0, : mask.size(1)] = mask.bool().repeat_interleave(n, dim=0)
        self.col = mask.size(1)

    def keep(self, idx: torch.Tensor) -> None:
        """Keep only the live rows ``idx`` (indices into the current rows)."""
        self.keys = [k[idx] for k in self.keys]
        self.values = [v[idx] for v in self.values]
        self.mask = self.mask[idx]

    def __call__(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Logits of the next token after ``tokens`` (one per row) at ``position``."""
        col = self.col
        self.mask[:, 0, 0, col] = True
        mask = self.mask[:, :, :, : col + 1]
        h = self.inner.embed_tokens(tokens[:, None])
        cos, sin = self.inner.rotary_emb(h, position)
        for i, layer in enumerate(self.inner.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            shape = (x.size(0), 1, -1, attn.head_dim)
            q = attn.q_proj(x).view(shape).transpose(1, 2)
            k = attn.k_proj(x).view(shape).transpose(1, 2)
            v = attn.v_proj(x).view(shape).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            self.keys[i][:, :, col : col + 1] = k
            self.values[i][:, :, col : col + 1] = v
            out = F.scaled_dot_product_attention(
                q,
                self.keys[i][:, :, : col + 1],
                self.values[i][:, :, : col + 1],
                attn_mask=mask,
                scale=attn.scaling,
                enable_gqa=self.keys[i].size(1) != q.size(1),
            )
            h = h + attn.o_proj(out.transpose(1, 2).reshape(x.size(0), 1, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        self.col += 1
        return self.model.lm_head(self.inner.norm(h))[:, -1, :].float()


def pass_rates(
    student: Student,
    items: Sequence[Verified],
    n: int = 8,
    *,
    temperature: float = 1.0,
    max_new_tokens: int = 96,
    seed: int = 0,
    chunk: int = 64,
) -> list[float]:
    """Per problem: the share of ``n`` sampled completions whose answer matches the verified one."""
    rates: list[float] = []
    for start in range(0, len(items), chunk):
        part = items[start : start + chunk]
        samples = student.sample(
            [prompt_of(v.problem.question) for v in part],
            n,
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            seed=seed + start,
        )
        if len(samples) != len(part) or any(len(s) != n for s in samples):
            raise ValueError(
                f"student {student.name}: expected {n} completions for each of {len(part)} prompts"
            )
        rates += [sum(grade(c, v.answer) for c in s) / n for v, s in zip(part, samples, strict=True)]
    return rates


def histogram(rates: Sequence[float], bins: int = HISTOGRAM_BINS) -> dict[str, int]:
    """Counts of pass rates in ``bins`` equal bins over [0, 1] (the last one closed), keyed
    ``"0.0-0.1"`` ..."""
    counts = [0] * bins
    for r in rates:
        counts[min(bins - 1, max(0, int(r * bins)))] += 1
    return {f"{i / bins:.1f}-{(i + 1) / bins:.1f}": c for i, c in enumerate(counts)}


class EmptyBandError(ValueError):
    """No problem's pass rate lies in the band; ``histogram`` says where they fell."""

    def __init__(self, lo: float, hi: float, rates: Sequence[float]) -> None:
        self.histogram = histogram(rates)
        super().__init__(
            f"no problem has a pass rate in [{lo}, {hi}] ({len(rates)} problems); "
            f"pass-rate histogram: {self.histogram}"
        )


@dataclass(frozen=True)
class BandResult:
    kept: list[Verified]
    rates: list[float]
    lo: float
    hi: float
    histogram: dict[str, int]
    below: int
    above: int

    def counts(self) -> dict[str, object]:
        return {
            "in": len(self.kept) + self.below + self.above,
            "kept": len(self.kept),
            "below_band": self.below,
            "above_band": self.above,
            "band": [self.lo, self.hi],
            "histogram": self.histogram,
        }


def check_band(lo: float, hi: float) -> None:
    if not 0.0 <= lo <= hi <= 1.0:
        raise ValueError(f"the band must satisfy 0 <= lo <= hi <= 1, got [{lo}, {hi}]")


def band_filter(
    items: Sequence[Verified], rates: Sequence[float], lo: float = 0.2, hi: float = 0.8
) -> BandResult:
    """The problems with ``lo <= rate <= hi`` (in order) and their rates; :class:`EmptyBandError`
    when there are none."""
    check_band(lo, hi)
    if len(items) != len(rates):
        raise ValueError(f"{len(items)} problems but {len(rates)} pass rates")
    kept = [(v, r) for v, r in zip(items, rates, strict=True) if lo <= r <= hi]
    if not kept:
        raise EmptyBandError(lo, hi, rates)
    return BandResult(
        [v for v, _ in kept],
        [r for _, r in kept],
        lo,
        hi,
        histogram(rates),
        sum(r < lo for r in rates),
        sum(r > hi for r in rates),
    )
