"""How one engine step's sequences attend over the paged KV cache: the plan, built once per step
and read by every layer of :class:`forge_model_server.model.llama.LlamaModel`.

- **decoding sequences** (one new token each) go to the native kernel (:class:`KernelDecode`:
  their block tables and context lengths), or, with torch's batched matmuls, read the cache where
  it lies (:class:`DecodePlan`): the pool range the step's sequences use, in place while it stays
  dense, every other block (and a block shared by several sequences beyond its first owner)
  gathered into a buffer;
- **prefilling sequences** (a chunk of several tokens) each get their causal mask, and the
  additive bias of the explicit path when their scores are small enough (:class:`Prefill`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Decode attention reads a run of pool blocks in place while the run spans at most this many times
#: the blocks it needs; a sparser one is gathered (one read, one write and a second read of each).
IN_PLACE_MAX_SPAN = 3
#: Blocks nobody in the step needs that a run may skip over: reading a few idle blocks costs less
#: than the extra products of one more run.
IN_PLACE_MAX_HOLE = 8
#: Runs shorter than this are gathered, and at most this many runs are read in place per step.
IN_PLACE_MIN_RUN = 4
IN_PLACE_MAX_RUNS = 16
#: A prefill chunk whose scores ([heads, chunk, context] floats) fit this many is attended with
#: explicit matmuls and softmax: 2-2.5x faster than ``scaled_dot_product_attention`` on CPU, which
#: runs its math fallback there for GQA and masks (measured); a larger one uses SDPA, which tiles.
EXPLICIT_SCORES_MAX = 1 << 22


@dataclass(frozen=True)
class BatchLayout:
    """Where each token of one step comes from and goes to; built by the engine, read by the model.

    ``positions`` and ``slots`` (``block * block_size + offset`` in the cache) are per flat token;
    ``query_start`` splits the flat tokens by sequence; ``context_lens`` is how many positions each
    sequence sees after this step; ``block_tables`` lists each sequence's cache blocks in position
    order (at least enough for its context).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    query_start: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]


@dataclass(frozen=True)
class CacheShape:
    """What planning needs of the model and its cache."""

    num_heads: int
    num_kv_heads: int
    block_size: int
    dtype: torch.dtype


@dataclass(frozen=True)
class BlockRun:
    """Cache blocks one pair of decode products reads: the pool range ``start:stop`` in place, or
    the listed ``blocks`` gathered into a buffer."""

    start: int = 0
    stop: int = 0
    blocks: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.stop - self.start if self.blocks is None else int(self.blocks.shape[0])


@dataclass(frozen=True)
class DecodePlan:
    """The step's single-token sequences: their flat rows, the block runs they read and, for every
    block of those runs in order, its owner (the decode row) and the additive mask of its slots
    (``[blocks, kv_heads, groups, block_size]``: 0, or -inf beyond the owner's context). A block
    nobody in the step reads is masked whole and lent to row 0, where it adds exactly nothing.
    Built once per step, read by every layer."""

    rows: torch.Tensor
    runs: list[BlockRun]
    owner: torch.Tensor
    bias: torch.Tensor


@dataclass(frozen=True)
class KernelDecode:
    """The step's single-token sequences for the native kernel: their flat rows, block tables
    (``[seqs, max_blocks]`` int32, padded with block 0) and context lengths (int32)."""

    rows: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor


@dataclass(frozen=True)
class Prefill:
    """A sequence computing a chunk of several tokens: its flat rows, context, blocks and causal
    mask (``[chunk, context]``, True where a query may look), and that mask as the additive bias
    of the explicit path (``[groups * chunk, context]``; None when SDPA runs), built once per step
    for every layer. A first chunk (``fresh``) attends only to its own new keys; a later one
    gathers its context."""

    start: int
    end: int
    context: int
    blocks: torch.Tensor
    mask: torch.Tensor
    bias: torch.Tensor | None

    @property
    def fresh(self) -> bool:
        return self.context == self.end - self.start


@dataclass(frozen=True)
class Plan:
    decode: DecodePlan | KernelDecode | None
    prefill: list[Prefill]


def plan_step(batch: BatchLayout, shape: CacheShape, *, native: bool) -> Plan:
    """Split the step's sequences into decoding ones (attend together) and prefilling ones;
    ``native``: the decoding ones go to the native kernel."""
    bs, c = shape.block_size, shape
    groups = c.num_heads // c.num_kv_heads
    decode: list[tuple[int, int, list[int]]] = []
    prefill: list[Prefill] = []
    for i, ctx in enumerate(batch.context_lens):
        start, end = batch.query_start[i], batch.query_start[i + 1]
        table = batch.block_tables[i][: -(-ctx // bs)]
        if end - start == 1:
            decode.append((start, ctx, table))
            continue
        n = end - start
        mask = torch.ones(n, ctx, dtype=torch.bool).tril(diagonal=ctx - n)  # query i is at ctx - n + i
        bias = None
        if c.num_heads * n * ctx <= EXPLICIT_SCORES_MAX:
            bias = torch.zeros(n, ctx, dtype=shape.dtype).masked_fill_(~mask, float("-inf"))
            bias = bias.repeat(groups, 1) if groups > 1 else bias
        prefill.append(Prefill(start, end, ctx, torch.tensor(table, dtype=torch.long), mask, bias))
    if not decode:
        return Plan(None, prefill)
    if not native:
        return Plan(decode_plan(decode, shape), prefill)
    width = max(len(table) for _, _, table in decode)
    return Plan(
        KernelDecode(
            rows=torch.tensor([row for row, _, _ in decode]),
            block_tables=torch.tensor(
                [table + [0] * (width - len(table)) for _, _, table in decode], dtype=torch.int32
            ),
            context_lens=torch.tensor([ctx for _, ctx, _ in decode], dtype=torch.int32),
        ),
        prefill,
    )


def decode_plan(seqs: list[tuple[int, int, list[int]]], shape: CacheShape) -> DecodePlan:
    """Which blocks the decoding sequences read, and how (see the module docstring).

    1. List (block, owner, valid slots) for every block of every sequence; a block already
       listed for another sequence (a shared prefix) is gathered for the later ones.
    2. Cut the sorted blocks into runs at holes of more than ``IN_PLACE_MAX_HOLE`` blocks;
       the longest dense runs are read in place, every other block is gathered.
    """
    bs, c = shape.block_size, shape
    # 1. Every block with its owner and valid slots.
    entries: list[tuple[int, int, int]] = []
    for i, (_, ctx, table) in enumerate(seqs):
        last = len(table) - 1
        entries += [(block, i, bs) for block in table[:last]]
        entries.append((table[last], i, ctx - last * bs))
    gathered: list[tuple[int, int, int]] = []
    if len({e[0] for e in entries}) < len(entries):
        seen: set[int] = set()
        unique: list[tuple[int, int, int]] = []
        for entry in entries:
            (gathered if entry[0] in seen else unique).append(entry)
            seen.add(entry[0])
        entries = unique
    # 2. Runs.
    entries.sort()
    runs: list[list[tuple[int, int, int]]] = [[entries[0]]]
    for entry in entries[1:]:
        if entry[0] - runs[-1][-1][0] > IN_PLACE_MAX_HOLE + 1:
            runs.append([])
        runs[-1].append(entry)
    dense = [
        r for r in runs if len(r) >= IN_PLACE_MIN_RUN and r[-1][0] + 1 - r[0][0] <= IN_PLACE_MAX_SPAN * len(r)
    ]
    dense = sorted(dense, key=len, reverse=True)[:IN_PLACE_MAX_RUNS]
    chosen = {id(r) for r in dense}
    gathered += [e for r in runs if id(r) not in chosen for e in r]
    plan_runs: list[BlockRun] = []
    owners: list[int] = []
    limits: list[int] = []
    for run in dense:
        lo, hi = run[0][0], run[-1][0] + 1
        run_owners, run_limits = [0] * (hi - lo), [0] * (hi - lo)
        for block, owner, limit in run:
            run_owners[block - lo], run_limits[block - lo] = owner, limit
        plan_runs.append(BlockRun(start=lo, stop=hi))
        owners += run_owners
        limits += run_limits
    if gathered:
        plan_runs.append(BlockRun(blocks=torch.tensor([e[0] for e in gathered])))
        owners += [e[1] for e in gathered]
        limits += [e[2] for e in gathered]
    invalid = torch.arange(bs)[None, :] >= torch.tensor(limits)[:, None]
    bias = torch.zeros(len(owners), 1, 1, bs, dtype=shape.dtype).masked_fill_(
        invalid[:, None, None, :], float("-inf")
    )
    groups = c.num_heads // c.num_kv_heads
    return DecodePlan(
        rows=torch.tensor([row for row, _, _ in seqs]),
        runs=plan_runs,
        owner=torch.tensor(owners),
        bias=bias.expand(-1, c.num_kv_heads, groups, -1).contiguous(),
    )
