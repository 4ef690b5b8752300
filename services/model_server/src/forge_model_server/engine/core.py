"""The continuous-batching engine core: paged KV blocks, the scheduler, and one step at a time.

:class:`EngineCore` is synchronous and owns no thread, clock or event loop: a step is
``schedule()`` → ``execute()`` (one batched forward over every scheduled token) → ``update()``
(sample, detect the end, free blocks). :class:`~forge_model_server.engine.async_engine.AsyncEngine` drives it
live; tests drive ``step()`` directly, so what they check is exactly what runs.

Memory is a fixed pool of KV blocks (``block_size`` token slots each). A sequence holds a block
table; a full prompt block is registered under the hash of its tokens and everything before them,
so a later prompt with the same prefix reuses it (prefix caching). Cached blocks nobody holds stay
cached until the pool needs them. When a running sequence needs a block and none is free, the
lowest-priority running sequence is preempted: its blocks are freed and it goes back to waiting,
to be recomputed from its prompt and the tokens it has produced (vLLM's recompute preemption).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from enum import Enum

import torch

from forge_model_server.model.llama import LlamaModel
from forge_model_server.model.multimodal import (
    Encode,
    ImageSlice,
    ImageSpan,
    block_hashes,
    embed_rows,
    release_computed,
    step_images,
)
from forge_model_server.model.paged_plan import BatchLayout
from forge_model_server.sample.logits_processors import apply_logits_processors
from forge_model_server.sample.sampler import Logprob, SamplingParams, logprob_of, sample_rows


class BlockPool:
    """Fixed pool of KV-cache blocks with reference counts and a prefix cache of full blocks."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        # A heap: the lowest free block first, so the blocks in use stay a dense range that the
        # decode attention reads in place (llama.py).
        self._free = list(range(num_blocks))
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, int] = {}
        self._by_hash: dict[int, int] = {}
        # Cached blocks with no holder, oldest first: reused as-is on a hit, evicted when needed.
        self._evictable: OrderedDict[int, None] = OrderedDict()

    def num_free(self) -> int:
        """Blocks an allocation can take now (free, or cached and unheld)."""
        return len(self._free) + len(self._evictable)

    def usage(self) -> float:
        """Fraction of blocks held by sequences (``vllm:kv_cache_usage_perc``)."""
        return 1.0 - self.num_free() / self.num_blocks

    def allocate(self) -> int:
        if self._free:
            block = heapq.heappop(self._free)
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._by_hash[self._hash_of.pop(block)]
        self._refs[block] = 1
        return block

    def release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                heapq.heappush(self._free, block)

    def lookup(self, block_hash: int) -> int | None:
        """The cached block with this hash, now held by the caller; None on a miss."""
        block = self._by_hash.get(block_hash)
        if block is None:
            return None
        self._evictable.pop(block, None)
        self._refs[block] += 1
        return block

    def register(self, block: int, block_hash: int) -> None:
        """Make a full, computed block findable by its hash (first writer wins)."""
        if block_hash not in self._by_hash and block not in self._hash_of:
            self._by_hash[block_hash] = block
            self._hash_of[block] = block_hash


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One request inside the engine."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    arrival: int
    generator: torch.Generator
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    text: str = ""
    emitted_chars: int = 0
    block_hashes: list[int] = field(default_factory=list)
    num_registered: int = 0
    logprobs: list[Logprob] = field(default_factory=list)
    prompt_logprobs: list[Logprob | None] = field(default_factory=list)
    images: list[ImageSpan] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens ``start:end`` of prompt + output, without copying the whole sequence."""
        prompt = len(self.prompt_ids)
        if end <= prompt:
            return self.prompt_ids[start:end]
        if start >= prompt:
            return self.output_ids[start - prompt : end - prompt]
        return self.prompt_ids[start:] + self.output_ids[: end - prompt]

    @property
    def order(self) -> tuple[int, int]:
        """Scheduling order: lower priority value first, then first come."""
        return (self.priority, self.arrival)


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: tuple[Logprob, ...] = ()
    prompt_logprobs: tuple[Logprob | None, ...] | None = None


@dataclass(frozen=True)
class ScheduledBatch:
    """The sequences of one step and how many of their tokens each computes."""

    seqs: list[Sequence]
    num_tokens: list[int]


@dataclass(frozen=True)
class StepInput:
    """One step's model input: the flat layout, the flat rows whose logits are computed, and which
    of those rows serves (sequence index in the batch, position)."""

    layout: BatchLayout
    logit_rows: torch.Tensor
    rows: dict[tuple[int, int], int]
    images: tuple[ImageSlice, ...] = ()


@dataclass(frozen=True)
class EngineConfig:
    """Sizes of the engine; see ``ModelServerSettings`` for their meaning and defaults."""

    num_blocks: int = 256
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True


@dataclass
class EngineStats:
    """Counters since start; the async engine turns them into vLLM metrics."""

    num_preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0


Detokenize = Callable[[list[int]], str]


class EngineCore:
    """Schedules sequences over the block pool and runs them through the model one step at a time."""

    def __init__(
        self,
        model: LlamaModel,
        config: EngineConfig,
        detokenize: Detokenize,
        eos_token_ids: tuple[int, ...] = (),
        encode: Encode | None = None,
    ) -> None:
        self.model = model
        self.encode = encode
        """The vision encoder of a vision-language model (:mod:`.multimodal`); None: text only."""
        self.config = config
        self.pool = BlockPool(config.num_blocks)
        self.stats = EngineStats()
        self._detokenize = detokenize
        self._eos = set(eos_token_ids)
        self._arrivals = itertools.count()
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}

    # -- admission ------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        seed: int,
        priority: int = 0,
        images: Seq[ImageSpan] = (),
    ) -> Sequence:
        """Queue a request; one that could never fit the pool is refused, or it would wait forever."""
        if request_id in self._by_id:
            raise ValueError(f"request id {request_id} is already in the engine")
        need = self.blocks_needed(len(prompt_ids) + params.max_tokens)
        if images and self.encode is None:
            raise ValueError(f"request {request_id} has images; this model reads none")
        if need > self.config.num_blocks:
            raise ValueError(
                f"request {request_id} needs {need} KV blocks; the pool has {self.config.num_blocks}"
            )
        bs = self.config.block_size
        seq = Sequence(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            params=params,
            priority=priority,
            arrival=next(self._arrivals),
            generator=torch.Generator().manual_seed(seed),
            images=list(images),
        )
        # Image pieces are part of a block's key: equal placeholders, different images, no sharing.
        seq.block_hashes = block_hashes(prompt_ids, bs, seq.images)
        self.waiting.append(seq)
        self._by_id[request_id] = seq
        return seq

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is and free its blocks (client gone, deadline passed)."""
        seq = self._by_id.pop(request_id, None)
        if seq is None:
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        self._free_blocks(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = seq.finish_reason or "cancelled"

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """1. schedule  2. run one batched forward  3. sample, stop, free."""
        batch = self.schedule()
        if not batch.seqs:
            return []
        inputs = self.prepare(batch)
        logits = self.execute(inputs)
        return self.update(batch, inputs, logits)

    def schedule(self) -> ScheduledBatch:
        """Pick this step's sequences and token counts under the token budget.

        1. Running sequences, highest priority first, each gets its next chunk (one token when
           decoding). A sequence that needs a block when none is free preempts the lowest-priority
           running sequence (possibly itself).
        2. If nothing was preempted, waiting sequences join in priority order while the budget,
           ``max_num_seqs`` and the pool allow, reusing cached prefix blocks.
        3. A waiting sequence that does not fit preempts the lowest-priority running sequence if that
           one has a strictly lower priority (higher value), as vLLM's priority policy; otherwise
           admission stops there, so lower priorities never overtake it.
        """
        budget = self.config.max_num_batched_tokens
        seqs: list[Sequence] = []
        counts: list[int] = []
        preempted = False
        # 1. Running sequences.
        self.running.sort(key=lambda s: s.order)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            need = self.blocks_needed(seq.num_computed + n) - len(seq.block_table)
            while need > self.pool.num_free():
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break
            for _ in range(need):
                seq.block_table.append(self.pool.allocate())
            seqs.append(seq)
            counts.append(n)
            budget -= n
            i += 1
        # 2. Waiting sequences.
        while self.waiting and not preempted and budget > 0:
            self.waiting.sort(key=lambda s: s.order)
            seq = self.waiting[0]
            full = len(self.running) >= self.config.max_num_seqs
            if full or not self._admit(seq, budget):
                # 3. No room: a lower-priority running sequence gives its place up, or admission stops.
                lowest = max(self.running, key=lambda s: s.order, default=None)
                if lowest is None or lowest.priority <= seq.priority:
                    break
                if lowest in seqs:
                    k = seqs.index(lowest)
                    seqs.pop(k)
                    budget += counts.pop(k)
                self._preempt(lowest)
                continue
            self.waiting.pop(0)
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = min(seq.num_tokens - seq.num_computed, budget)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        return ScheduledBatch(seqs, counts)

    def _admit(self, seq: Sequence, budget: int) -> bool:
        """Give ``seq`` its cached prefix and the blocks of its first chunk, or nothing."""
        bs = self.config.block_size
        total = seq.num_tokens
        hits: list[int] = []
        use_cache = self.config.enable_prefix_caching and seq.params.prompt_logprobs is None
        if use_cache:
            # The last token is always computed, so its logits exist to sample from.
            for block_hash in seq.block_hashes[: (total - 1) // bs]:
                block = self.pool.lookup(block_hash)
                if block is None:
                    break
                hits.append(block)
        computed = len(hits) * bs
        n = min(total - computed, budget)
        need = self.blocks_needed(computed + n) - len(hits)
        if need > self.pool.num_free():
            for block in hits:
                self.pool.release(block)
            return False
        if use_cache:
            self.stats.prefix_queries += total
            self.stats.prefix_hits += computed
        seq.block_table = hits + [self.pool.allocate() for _ in range(need)]
        seq.num_computed = computed
        seq.num_registered = len(hits)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free_blocks(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.waiting.append(seq)
        self.stats.num_preemptions += 1

    def _free_blocks(self, seq: Sequence) -> None:
        # Freed tail first, so the prefix blocks are the last to be evicted.
        for block in reversed(seq.block_table):
            self.pool.release(block)
        seq.block_table = []
        seq.num_registered = 0

    def prepare(self, batch: ScheduledBatch) -> StepInput:
        """Flatten the step's tokens and pick the rows whose logits are needed."""
        bs = self.config.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        context_lens: list[int] = []
        tables: list[list[int]] = []
        rows: dict[tuple[int, int], int] = {}
        logit_rows: list[int] = []
        images: list[ImageSlice] = []
        for k, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens, strict=True)):
            start, end = seq.num_computed, seq.num_computed + n
            first = len(ids)
            table = seq.block_table
            ids += seq.token_ids(start, end)
            if seq.images:
                images += step_images(seq.images, start, end, first)
            positions += range(start, end)
            slots += [table[pos // bs] * bs + pos % bs for pos in range(start, end)]
            if seq.params.prompt_logprobs is not None:
                # Prompt positions whose logprob is not recorded yet (a recomputed one has it).
                for pos in range(start, min(end, len(seq.prompt_ids) - 1)):
                    if len(seq.prompt_logprobs) <= pos + 1:
                        rows[(k, pos)] = len(logit_rows)
                        logit_rows.append(first + pos - start)
            if end == seq.num_tokens:  # the last token's logits give the next token
                rows[(k, end - 1)] = len(logit_rows)
                logit_rows.append(first + n - 1)
            starts.append(len(ids))
            context_lens.append(end)
            tables.append(table)
        layout = BatchLayout(
            input_ids=torch.tensor(ids, dtype=torch.long),
            positions=torch.tensor(positions, dtype=torch.long),
            slots=torch.tensor(slots, dtype=torch.long),
            query_start=starts,
            context_lens=context_lens,
            block_tables=tables,
        )
        return StepInput(layout, torch.tensor(logit_rows, dtype=torch.long), rows, tuple(images))

    def execute(self, inputs: StepInput) -> torch.Tensor:
        """The batched forward; pure with respect to the scheduler, so it may run on a thread. The
        step's new images are encoded first, in one batch, and fill their placeholder rows."""
        embeds = None
        if inputs.images and self.encode is not None:
            embeds = embed_rows(inputs.images, self.encode)
        return self.model.forward(inputs.layout, inputs.logit_rows, embeds)

    def update(self, batch: ScheduledBatch, inputs: StepInput, logits: torch.Tensor) -> list[RequestOutput]:
        """Advance each sequence: record prompt logprobs, sample, check the stops, free blocks.

        1. Every sequence counts its computed tokens, records prompt logprobs and registers its
           full prompt blocks for prefix caching.
        2. Those whose last token was computed sample the next one, all in one call, after the
           batched logits processors (penalties, ``logit_bias``, ``min_tokens``).
        3. Each of them gets its token, logprobs, text and stop check.
        """
        bs = self.config.block_size
        rows = inputs.rows
        # 1. Advance.
        ready: list[tuple[Sequence, int]] = []
        for k, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens, strict=True)):
            if seq.status is not Status.RUNNING:
                continue  # aborted while the forward ran
            start = seq.num_computed
            seq.num_computed += n
            release_computed(seq.images, seq.num_computed)
            self._prompt_logprobs(seq, k, start, n, rows, logits)
            while (
                seq.num_registered < len(seq.block_hashes)
                and (seq.num_registered + 1) * bs <= seq.num_computed
            ):
                self.pool.register(seq.block_table[seq.num_registered], seq.block_hashes[seq.num_registered])
                seq.num_registered += 1
            if seq.num_computed == seq.num_tokens:  # else chunked prefill continues next step
                ready.append((seq, rows[(k, seq.num_tokens - 1)]))
        if not ready:
            return []
        # 2. Sample.
        last = logits[torch.tensor([row for _, row in ready])]
        params = [seq.params for seq, _ in ready]
        processed = apply_logits_processors(
            last,
            params,
            [seq.prompt_ids for seq, _ in ready],
            [seq.output_ids for seq, _ in ready],
            sorted(self._eos),
        )
        tokens = sample_rows(processed, params, [seq.generator for seq, _ in ready])
        # 3. Emit.
        outputs: list[RequestOutput] = []
        for i, ((seq, _), token) in enumerate(zip(ready, tokens, strict=True)):
            seq.output_ids.append(token)
            lp: tuple[Logprob, ...] = ()
            if seq.params.logprobs is not None:
                logprob = logprob_of(last[i], token, seq.params.logprobs)
                seq.logprobs.append(logprob)
                lp = (logprob,)
            outputs.append(self._emit(seq, token, lp))
        return outputs

    def _prompt_logprobs(
        self,
        seq: Sequence,
        k: int,
        start: int,
        n: int,
        rows: dict[tuple[int, int], int],
        logits: torch.Tensor,
    ) -> None:
        if seq.params.prompt_logprobs is None:
            return
        if not seq.prompt_logprobs:
            seq.prompt_logprobs.append(None)  # the first prompt token has no context
        for pos in range(start, start + n):
            if (k, pos) in rows and pos + 1 < len(seq.prompt_ids) and len(seq.prompt_logprobs) == pos + 1:
                row = logits[rows[(k, pos)]]
                seq.prompt_logprobs.append(
                    logprob_of(row, seq.prompt_ids[pos + 1], seq.params.prompt_logprobs)
                )

    def _emit(self, seq: Sequence, token: int, lp: tuple[Logprob, ...]) -> RequestOutput:
        """Detokenize, apply stop strings, EOS and max_tokens, and hold back a possible stop prefix."""
        params = seq.params
        seq.text = self._detokenize(seq.output_ids)
        finish: str | None = None
        # Before min_tokens nothing but max_tokens ends the output (vLLM's stop checker).
        may_stop = len(seq.output_ids) >= params.min_tokens
        for stop in params.stop if may_stop else ():
            at = seq.text.find(stop)
            if at >= 0:
                seq.text = seq.text[:at]
                finish = "stop"
        if finish is None and may_stop and token in self._eos and not params.ignore_eos:
            finish = "stop"
        if finish is None and len(seq.output_ids) >= params.max_tokens:
            finish = "length"
        visible = len(seq.text)
        if finish is None:
            visible -= _holdback(seq.text, params.stop)
        delta = seq.text[seq.emitted_chars : max(visible, seq.emitted_chars)]
        seq.emitted_chars = max(visible, seq.emitted_chars)
        prompt_lps: tuple[Logprob | None, ...] | None = None
        if len(seq.output_ids) == 1 and params.prompt_logprobs is not None:
            prompt_lps = tuple(seq.prompt_logprobs)
        if finish is not None:
            seq.finish_reason = finish
            seq.status = Status.FINISHED
            self.running.remove(seq)
            self._free_blocks(seq)
            self._by_id.pop(seq.request_id, None)
        return RequestOutput(
            request_id=seq.request_id,
            token_ids=(token,),
            text=delta,
            finish_reason=finish,
            prompt_tokens=len(seq.prompt_ids),
            completion_tokens=len(seq.output_ids),
            logprobs=lp,
            prompt_logprobs=prompt_lps,
        )


def _holdback(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of ``text`` not to stream yet: a stop string may be starting there,
    or a multi-byte character is still incomplete."""
    held = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:length]):
                held = max(held, length)
                break
    if text.endswith("\ufffd"):
        held = max(held, 1)
    return held
