"""The Llama forward pass over a paged KV cache, reading ``transformers.LlamaForCausalLM`` weights.

One call runs every scheduled token of every sequence in the step as one flat batch: the
projections (q/k/v fused into one weight, gate/up into another) and the MLP are single matmuls over
all tokens, on weights packed once at load (:class:`~forge_model_server.model.kernels.Linear`). Attention writes the new keys and values into their cache slots, then:

- **decoding sequences** (one new token each) read the cache where it lies, as PagedAttention
  does: by default through the native kernel of :mod:`.kernels` (one pass over each sequence's
  blocks with an online softmax); where that cannot be built, or with ``decode_attention="torch"``,
  all together, block by block, with torch's batched matmuls:
  one product of every block with its owner's query gives the scores, the softmax runs across each
  sequence's blocks with a per-sequence max and sum (as flash-decoding combines its splits), and a
  second product with the value blocks, summed per sequence, gives the output. The blocks are the
  pool range the step's sequences use, read in place (the pool hands out its lowest free blocks, so
  that range stays dense); a sparse range, and a block shared by several sequences (prefix cache)
  beyond its first owner, is gathered into a buffer kept across steps.
- **prefilling sequences** (a chunk of several tokens) run ``scaled_dot_product_attention`` one by
  one: a first chunk causally on its own new keys, a later chunk on its context gathered from its
  blocks.

Which path each sequence takes is planned once per step (:mod:`.paged_plan`); this module runs it.
The arithmetic follows ``modeling_llama`` (RMSNorm in float32, rotate-half RoPE, GQA, SwiGLU) so the
logits match transformers on the same weights; a test holds it to that.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import structlog
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from forge_model_server.model.kernels import (
    KernelUnavailableError,
    Linear,
    PagedDecodeAttention,
    paged_decode_attention,
)
from forge_model_server.model.paged_plan import (
    BatchLayout,
    BlockRun,
    CacheShape,
    DecodePlan,
    KernelDecode,
    Plan,
    Prefill,
    plan_step,
)

log = structlog.get_logger(__name__)


DecodeAttention = Literal["auto", "native", "torch"]
"""How decoding sequences attend: ``native`` is the one-pass kernel of :mod:`.kernels` (float32
only; an error where it cannot be built), ``torch`` the batched matmuls below, ``auto`` the kernel
where it builds and torch elsewhere."""


def _decode_kernel(choice: DecodeAttention, dtype: torch.dtype) -> PagedDecodeAttention | None:
    if choice == "torch":
        return None
    if dtype != torch.float32:
        if choice == "native":
            raise KernelUnavailableError(f"the native decode attention is float32 only, not {dtype}")
        return None
    try:
        return paged_decode_attention()
    except KernelUnavailableError as exc:
        if choice == "native":
            raise
        log.warning("kernel.unavailable", fallback="torch", reason=str(exc))
        return None


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


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's weights, with q/k/v and gate/up each fused into one matmul."""

    input_norm: torch.Tensor
    qkv: Linear
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear

    @classmethod
    def fuse(cls, w: dict[str, torch.Tensor], prefix: str) -> _Layer:
        def weight(*names: str) -> torch.Tensor:
            return torch.cat([w[f"{prefix}{n}.weight"] for n in names])

        def bias(*names: str) -> torch.Tensor | None:
            found = [w.get(f"{prefix}{n}.bias") for n in names]
            if all(b is None for b in found):
                return None
            rows = [w[f"{prefix}{n}.weight"] for n in names]
            return torch.cat(
                [b if b is not None else r.new_zeros(r.shape[0]) for b, r in zip(found, rows, strict=True)]
            )

        attn, mlp = (
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            ("mlp.gate_proj", "mlp.up_proj"),
        )
        return cls(
            input_norm=w[f"{prefix}input_layernorm.weight"],
            qkv=Linear(weight(*attn), bias(*attn)),
            o=Linear(w[f"{prefix}self_attn.o_proj.weight"], w.get(f"{prefix}self_attn.o_proj.bias")),
            post_norm=w[f"{prefix}post_attention_layernorm.weight"],
            gate_up=Linear(weight(*mlp), bias(*mlp)),
            down=Linear(w[f"{prefix}mlp.down_proj.weight"], w.get(f"{prefix}mlp.down_proj.bias")),
        )


class _Scratch:
    """Gather buffers kept across steps: a new tensor of tens of MB per layer and step is fresh
    memory the kernel must fault in, which made a gather 6x slower (measured)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self._dtype = dtype
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        numel = math.prod(shape)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=self._dtype)
            self._buffers[key] = buffer
        return buffer[:numel].view(shape)


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
        decode_attention: DecodeAttention = "auto",
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.num_blocks = num_blocks
        w = {k: v.to(dtype) for k, v in weights.items()}
        missing = [k for k in self._required() if k not in w]
        if missing:
            raise UnsupportedModelError(f"weights missing from the checkpoint: {', '.join(missing[:5])}")
        self._embed = w["model.embed_tokens.weight"]
        self._norm = w["model.norm.weight"]
        self._lm_head = Linear(w.get("lm_head.weight", self._embed), None)
        self._layers = [_Layer.fuse(w, f"model.layers.{i}.") for i in range(config.num_layers)]
        c = config
        self._inv_freq = 1.0 / (
            c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.int64).float() / c.head_dim)
        )
        # Per layer and block, each KV head's slots are contiguous: [block, kv_head, slot, dim], so
        # a block range is one strided batch of [slot, dim] matrices for the decode products.
        shape = (c.num_layers, num_blocks, c.num_kv_heads, block_size, c.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype)
        self.v_cache = torch.zeros(shape, dtype=dtype)
        self._scratch = _Scratch(dtype)
        self._shape = CacheShape(c.num_heads, c.num_kv_heads, block_size, dtype)
        self._kernel = _decode_kernel(decode_attention, dtype)

    @property
    def decode_attention(self) -> str:
        """Which decode attention runs: ``native`` (the kernel) or ``torch``."""
        return "torch" if self._kernel is None else "native"

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
    def load(
        cls, folder: Path, *, num_blocks: int, block_size: int, decode_attention: DecodeAttention = "auto"
    ) -> LlamaModel:
        """Read ``config.json`` and every ``*.safetensors`` file of a Hugging Face folder."""
        config = LlamaConfig.from_json(json.loads((folder / "config.json").read_text()))
        weights: dict[str, torch.Tensor] = {}
        for path in sorted(folder.glob("*.safetensors")):
            weights.update(load_file(str(path)))
        return cls(
            config, weights, num_blocks=num_blocks, block_size=block_size, decode_attention=decode_attention
        )

    @torch.inference_mode()
    def forward(
        self,
        batch: BatchLayout,
        logit_rows: torch.Tensor,
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run the step; return float32 logits for the flat token rows in ``logit_rows``.
        ``embeds`` (flat rows, vectors) replaces those rows' token embeddings: a vision-language
        model's image embeddings at its placeholder tokens."""
        c = self.config
        n_tokens = batch.input_ids.shape[0]
        q_width, kv_width = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        if embeds is None:
            x = F.embedding(batch.input_ids, self._embed)
        else:
            # A placeholder id may lie past the text vocabulary: its row is overwritten anyway.
            x = F.embedding(batch.input_ids.clamp(max=c.vocab_size - 1), self._embed)
            x = x.index_copy(0, embeds[0], embeds[1].to(x.dtype))
        freqs = batch.positions.float()[:, None] * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(x.dtype)[:, None, :]
        sin = emb.sin().to(x.dtype)[:, None, :]
        plan = plan_step(batch, self._shape, native=self._kernel is not None)
        # Row of each (token, kv head) in a layer's cache seen as [block * kv_head * slot, dim].
        blocks = torch.div(batch.slots, self.block_size, rounding_mode="floor")
        heads = torch.arange(c.num_kv_heads)
        write_rows = (blocks[:, None] * c.num_kv_heads + heads) * self.block_size + (
            batch.slots % self.block_size
        )[:, None]
        write_rows = write_rows.view(-1)
        for layer, w in enumerate(self._layers):
            h = _rms_norm(x, w.input_norm, c.rms_norm_eps)
            qkv = w.qkv(h)
            # q and k are adjacent in the fused output: one rotation for both.
            qk = qkv[:, : q_width + kv_width].view(n_tokens, c.num_heads + c.num_kv_heads, c.head_dim)
            qk = qk * cos + _rotate_half(qk) * sin
            q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
            v = qkv[:, q_width + kv_width :].view(n_tokens, c.num_kv_heads, c.head_dim)
            self.k_cache[layer].view(-1, c.head_dim).index_copy_(0, write_rows, k.reshape(-1, c.head_dim))
            self.v_cache[layer].view(-1, c.head_dim).index_copy_(0, write_rows, v.reshape(-1, c.head_dim))
            attn = self._attend(layer, q, k, v, plan)
            x = x + w.o(attn.view(n_tokens, q_width))
            h = _rms_norm(x, w.post_norm, c.rms_norm_eps)
            gate, up = w.gate_up(h).chunk(2, dim=-1)
            x = x + w.down(F.silu(gate) * up)
        x = _rms_norm(x[logit_rows], self._norm, c.rms_norm_eps)
        return self._lm_head(x).float()

    # -- attention ------------------------------------------------------------------------------

    def _attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        if isinstance(plan.decode, KernelDecode) and self._kernel is not None:
            d = plan.decode
            queries = q.index_select(0, d.rows)
            attended = torch.empty_like(queries)
            self._kernel(
                attended,
                queries,
                self.k_cache[layer],
                self.v_cache[layer],
                d.block_tables,
                d.context_lens,
                self.config.head_dim**-0.5,
            )
            out.index_copy_(0, d.rows, attended)
        elif isinstance(plan.decode, DecodePlan):
            rows = plan.decode.rows
            out.index_copy_(0, rows, self._decode_attention(layer, q.index_select(0, rows), plan.decode))
        for seq in plan.prefill:
            span = slice(seq.start, seq.end)
            out[span] = self._prefill_attention(layer, q[span], k[span], v[span], seq)
        return out

    def _run_blocks(self, cache: torch.Tensor, run: BlockRun, key: str) -> torch.Tensor:
        """``[blocks, kv_heads, block_size, head_dim]`` of one run: a view, or a gathered copy."""
        if run.blocks is None:
            return cache[run.start : run.stop]
        out = self._scratch.get(key, (run.size, *cache.shape[1:]))
        return torch.index_select(cache, 0, run.blocks, out=out)

    def _decode_attention(self, layer: int, q: torch.Tensor, plan: DecodePlan) -> torch.Tensor:
        """One query token per sequence against its blocks, all sequences in the same products.

        1. Scores: per block, its owner's (pre-scaled) queries x the block's keys plus the block's
           mask (one batched matmul per run).
        2. Softmax across each sequence's blocks: the per-owner max, exp, the per-owner sum.
        3. Output: per block, probabilities x values (one batched matmul per run), summed per
           owner, divided by the sum. GQA: the query heads of one KV head ride in the query axis,
           so no KV head is copied.
        """
        c = self.config
        n = q.shape[0]
        kv, groups, dim, bs = c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim, self.block_size
        total_blocks = plan.owner.shape[0]
        mine = (q * dim**-0.5).view(n, kv, groups, dim).index_select(0, plan.owner)
        # 1. Scores.
        scores = q.new_empty(total_blocks, kv, groups, bs)
        at = 0
        for i, run in enumerate(plan.runs):
            keys, m = self._run_blocks(self.k_cache[layer], run, f"k{i}"), run.size
            torch.baddbmm(
                plan.bias[at : at + m].view(m * kv, groups, bs),
                mine[at : at + m].view(m * kv, groups, dim),
                keys.view(m * kv, bs, dim).transpose(1, 2),
                out=scores[at : at + m].view(m * kv, groups, bs),
            )
            at += m
        # 2. Softmax across blocks (every row owns at least one valid slot, so its max is finite).
        owner = plan.owner[:, None, None].expand(-1, kv, groups)
        top = q.new_empty(n, kv, groups).scatter_reduce_(
            0, owner, scores.amax(dim=-1), "amax", include_self=False
        )
        probs = scores.sub_(top.index_select(0, plan.owner)[..., None]).exp_()
        total = q.new_zeros(n, kv, groups).index_add_(0, plan.owner, probs.sum(dim=-1))
        # 3. Output.
        weighted = q.new_empty(total_blocks, kv, groups, dim)
        at = 0
        for i, run in enumerate(plan.runs):
            values, m = self._run_blocks(self.v_cache[layer], run, f"v{i}"), run.size
            torch.matmul(
                probs[at : at + m].view(m * kv, groups, bs),
                values.view(m * kv, bs, dim),
                out=weighted[at : at + m].view(m * kv, groups, dim),
            )
            at += m
        out = q.new_zeros(n, kv, groups, dim).index_add_(0, plan.owner, weighted)
        return out.div_(total[..., None]).view(n, c.num_heads, dim)

    def _prefill_attention(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: Prefill
    ) -> torch.Tensor:
        """Causal attention of one chunk: on its own new keys when it is the first chunk, else on
        its context gathered from the cache. GQA without copying KV heads: the query heads of one
        KV head ride in the query axis (explicit path) or SDPA's ``enable_gqa``."""
        c = self.config
        n, kv, dim = seq.end - seq.start, c.num_kv_heads, c.head_dim
        if seq.fresh:
            keys, values = k.transpose(0, 1), v.transpose(0, 1)
        else:
            keys = self._gather_context(self.k_cache[layer], seq, "pk")
            values = self._gather_context(self.v_cache[layer], seq, "pv")
        if seq.bias is None:
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1), keys, values, attn_mask=seq.mask, enable_gqa=True
            )
            return o.transpose(0, 1)
        groups = c.num_heads // kv
        queries = q.reshape(n, kv, groups, dim).permute(1, 2, 0, 3).reshape(kv, groups * n, dim)
        scores = torch.baddbmm(seq.bias, queries, keys.transpose(1, 2), alpha=dim**-0.5)
        o = torch.bmm(torch.softmax(scores, dim=-1), values)
        return o.view(kv, groups, n, dim).permute(2, 0, 1, 3).reshape(n, c.num_heads, dim)

    def _gather_context(self, cache: torch.Tensor, seq: Prefill, key: str) -> torch.Tensor:
        """``[kv_heads, context, head_dim]`` of one sequence, copied block by block from the cache
        (gathered along the cache's contiguous block axis: a gather across its head axis made torch
        copy the whole layer first)."""
        _, kv, bs, dim = cache.shape
        blocks = self._scratch.get(key, (seq.blocks.shape[0], kv, bs, dim))
        torch.index_select(cache, 0, seq.blocks, out=blocks)
        return blocks.transpose(0, 1).reshape(kv, -1, dim)[:, : seq.context]
