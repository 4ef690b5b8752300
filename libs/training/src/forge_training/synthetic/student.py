"""The local student: :class:`HFStudent` samples a Forge export or any Hugging Face causal LM
directory with torch (batched, left-padded, seeded), for the difficulty filter
(:mod:`forge_training.synthetic.difficulty`, whose :class:`~forge_training.synthetic.difficulty.Student`
protocol it follows) and the synthetic-data benchmark. Kept apart so that the workflow's steps that
only grade recorded samples (``curate``, ``band``) start without importing torch."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from forge_training.data import EOT


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
