"""The Llama forward pass over a paged KV cache, reading ``transformers.LlamaForCausalLM`` weights.

One call runs every scheduled token of every sequence in the step as one flat batch: the projections
and the MLP are single matmuls over all tokens; attention writes the new keys and values into their
cache slots, then gathers each sequence's keys and values block by block through its block table
and runs ``scaled_dot_product_attention`` for each sequence. The arithmetic follows ``modeling_llama`` (RMSNorm in float32, rotate-half RoPE, GQA,
SwiGLU) so the logits match transformers on the same weights; a test holds it to that.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


class UnsupportedModelError(ValueError):
    """The checkpoint is not a Llama this forward pass can run; the message names what differs."""


@dataclass(frozen=True)
class LlamaConfig:
    """The fields of a Hugging Face ``config.json`` that the forward pass reads."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LlamaConfig:
        """Read ``config.json``; anything but the default RoPE or a SiLU MLP is refused by name."""
        if data.get("model_type") != "llama":
            raise UnsupportedModelError(f"model_type is {data.get('model_type')!r}, expected 'llama'")
        rope: dict[str, Any] = data.get("rope_parameters") or data.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise UnsupportedModelError(f"rope type {rope_type!r} is not supported (only 'default')")
        if data.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {data.get('hidden_act')!r} is not supported")
        hidden = int(data["hidden_size"])
        heads = int(data["num_attention_heads"])
        eos = data.get("eos_token_id")
        eos_ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        return cls(
            vocab_size=int(data["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(data["intermediate_size"]),
            num_layers=int(data["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(data.get("num_key_value_heads") or heads),
            head_dim=int(data.get("head_dim") or hidden // heads),
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", data.get("rope_theta", 10000.0))),
            max_position_embeddings=int(data.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            eos_token_ids=tuple(int(e) for e in eos_ids),
        )


@dataclass(frozen=True)
class BatchLayout:
    """Where each token of one step comes from and goes to; built by the engine, read by the model.

    ``positions`` and ``slots`` are per flat token; ``context_slots`` is ``[num_seqs, max_context]``
    (every cache slot a sequence attends to, in position order, padded); ``query_start`` splits the
    flat tokens by sequence; ``context_lens`` is how many positions each sequence sees after this step.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    query_start: list[int]
    context_lens: list[int]
    context_slots: torch.Tensor


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaModel:
    """Weights of one Llama checkpoint and its paged KV cache; ``forward`` runs one engine step."""

    def __init__(
        self,
        config: LlamaConfig,
        weights: dict[str, torch.Tensor],
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._w = {k: v.to(dtype) for k, v in weights.items()}
        missing = [k for k in self._required() if k not in self._w]
        if missing:
            raise UnsupportedModelError(f"weights missing from the checkpoint: {', '.join(missing[:5])}")
        self._lm_head = self._w.get("lm_head.weight", self._w["model.embed_tokens.weight"])
        c = config
        inv_freq = 1.0 / (
            c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.int64).float() / c.head_dim)
        )
        self._inv_freq = inv_freq
        shape = (c.num_layers, num_blocks * block_size, c.num_kv_heads, c.head_dim)
        # One flat slot axis per layer: slot = block * block_size + offset.
        self.k_cache = torch.zeros(shape, dtype=dtype)
        self.v_cache = torch.zeros(shape, dtype=dtype)

    def _required(self) -> list[str]:
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        for i in range(self.config.num_layers):
            p = f"model.layers.{i}."
            names += [p + n + ".weight" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")]
            names += [p + n + ".weight" for n in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj")]
            names += [
                p + n + ".weight" for n in ("mlp.down_proj", "input_layernorm", "post_attention_layernorm")
            ]
        if not self.config.tie_word_embeddings:
            names.append("lm_head.weight")
        return names

    @classmethod
    def load(cls, folder: Path, *, num_blocks: int, block_size: int) -> LlamaModel:
        """Read ``config.json`` and every ``*.safetensors`` file of a Hugging Face folder."""
        config = LlamaConfig.from_json(json.loads((folder / "config.json").read_text()))
        weights: dict[str, torch.Tensor] = {}
        for path in sorted(folder.glob("*.safetensors")):
            weights.update(load_file(str(path)))
        return cls(config, weights, num_blocks=num_blocks, block_size=block_size)

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self._w[name + ".weight"], self._w.get(name + ".bias"))

    @torch.inference_mode()
    def forward(self, batch: BatchLayout, logit_rows: torch.Tensor) -> torch.Tensor:
        """Run the step; return float32 logits for the flat token rows in ``logit_rows``."""
        c = self.config
        n_tokens = batch.input_ids.shape[0]
        x = F.embedding(batch.input_ids, self._w["model.embed_tokens.weight"])
        freqs = batch.positions.float()[:, None] * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(x.dtype)[:, None, :]
        sin = emb.sin().to(x.dtype)[:, None, :]
        plan = self._attention_plan(batch)
        for layer in range(c.num_layers):
            p = f"model.layers.{layer}."
            h = _rms_norm(x, self._w[p + "input_layernorm.weight"], c.rms_norm_eps)
            q = self._linear(h, p + "self_attn.q_proj").view(n_tokens, c.num_heads, c.head_dim)
            k = self._linear(h, p + "self_attn.k_proj").view(n_tokens, c.num_kv_heads, c.head_dim)
            v = self._linear(h, p + "self_attn.v_proj").view(n_tokens, c.num_kv_heads, c.head_dim)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            self.k_cache[layer, batch.slots] = k
            self.v_cache[layer, batch.slots] = v
            attn = self._attend(layer, q, plan)
            x = x + self._linear(attn.reshape(n_tokens, c.num_heads * c.head_dim), p + "self_attn.o_proj")
            h = _rms_norm(x, self._w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
            gated = F.silu(self._linear(h, p + "mlp.gate_proj")) * self._linear(h, p + "mlp.up_proj")
            x = x + self._linear(gated, p + "mlp.down_proj")
        x = _rms_norm(x[logit_rows], self._w["model.norm.weight"], c.rms_norm_eps)
        return F.linear(x, self._lm_head).float()

    def _attention_plan(self, batch: BatchLayout) -> list[_SeqAttention]:
        """Per sequence, once for all layers: its blocks, and the causal mask of a prefill chunk.

        Sequences attend one by one: padding a batch to its longest context made the whole step
        3x slower on CPU (measured), far more than a Python loop over sequences costs.
        """
        bs = self.block_size
        plan = []
        for i, ctx in enumerate(batch.context_lens):
            start, end = batch.query_start[i], batch.query_start[i + 1]
            blocks = batch.context_slots[i, :ctx:bs] // bs
            mask = None
            if end - start > 1:
                q_pos = batch.positions[start:end]
                mask = torch.arange(ctx)[None, :] <= q_pos[:, None]
            plan.append(_SeqAttention(start, end, ctx, blocks, mask))
        return plan

    def _attend(self, layer: int, q: torch.Tensor, plan: list[_SeqAttention]) -> torch.Tensor:
        """GQA without copying KV heads: the query heads of one KV head ride in the query axis."""
        c = self.config
        groups = c.num_heads // c.num_kv_heads
        scale = c.head_dim**-0.5
        out = torch.empty_like(q)
        shape = (self.num_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        k_blocks, v_blocks = self.k_cache[layer].view(shape), self.v_cache[layer].view(shape)
        for seq in plan:
            n = seq.end - seq.start
            q_s = q[seq.start : seq.end].view(n, c.num_kv_heads, groups, c.head_dim).permute(1, 2, 0, 3)
            q_s = q_s.reshape(c.num_kv_heads, groups * n, c.head_dim)
            # Whole blocks are gathered (a block's slots are contiguous), then cut to the context.
            keys = k_blocks.index_select(0, seq.blocks).flatten(0, 1)[: seq.context].transpose(0, 1)
            values = v_blocks.index_select(0, seq.blocks).flatten(0, 1)[: seq.context].transpose(0, 1)
            mask = None if seq.mask is None else seq.mask.repeat(groups, 1)
            o = F.scaled_dot_product_attention(q_s, keys, values, attn_mask=mask, scale=scale)
            o = o.view(c.num_kv_heads, groups, n, c.head_dim).permute(2, 0, 1, 3)
            out[seq.start : seq.end] = o.reshape(n, c.num_heads, c.head_dim)
        return out


@dataclass(frozen=True)
class _SeqAttention:
    """One sequence's share of a step: its flat query rows, context length, blocks and mask
    (None when decoding one token, which sees its whole context)."""

    start: int
    end: int
    context: int
    blocks: torch.Tensor
    mask: torch.Tensor | None
