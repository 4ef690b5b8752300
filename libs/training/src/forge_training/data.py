"""Tokenizer and data pipeline: byte-level BPE, memory-mapped token shards, a resumable sampler.

:func:`prepare` trains the tokenizer on the corpus, splits the text (the last ``val_fraction``
for validation, as nanoGPT does), and writes each split as ``uint16`` shard files with an
``index.json`` (shard sizes and sha256), like Megatron's ``MMapIndexedDataset``. The result is
keyed by a hash of the corpus and the data config, so a second run reuses it.

:class:`StepSampler` decides which windows each rank reads. Its order depends only on the seed
and the epoch, and its state is one position in the *global* order (epoch, cursor), so a resumed
run reads exactly what the uninterrupted one would have read — with any world size.
:class:`MixtureSampler` does the same for several sources drawn by sampling weight (continual
pre-training): the source of every slot of a global batch comes from a generator seeded by
(seed, step), and each source walks its own per-epoch permutation.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from forge_training.datafiles import corpus_files
from forge_training.schema import DataConfig

TOKENIZER_FILE = "tokenizer.json"
INDEX_FILE = "index.json"
#: End-of-text token (also used as BOS/EOS/PAD in the exported tokenizer).
EOT = "<|endoftext|>"


def _read_text(path: Path, text_fields: str) -> str:
    """A ``.txt`` file as is; a ``.jsonl``/``.jsonl.gz`` file as its documents (the named fields
    of each line, one per line) separated by blank lines."""
    if not path.name.endswith((".jsonl", ".jsonl.gz")):
        return path.read_text(encoding="utf-8")
    fields = [f.strip() for f in text_fields.split(",") if f.strip()]
    opener = gzip.open if path.name.endswith(".gz") else open
    docs = []
    with opener(path, "rt", encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                row = json.loads(line)
                parts = [str(row[f]).strip() for f in fields if row.get(f)]
                if parts:
                    docs.append("\n".join(parts))
    return "\n\n".join(docs) + "\n"


def read_corpus(config: DataConfig) -> str:
    return "".join(_read_text(p, config.text_fields) for p in corpus_files(config.corpus))


def data_hash(config: DataConfig, tokenizer_json: str | None = None) -> str:
    """Hash of the corpus bytes and every setting that changes the token shards (including a
    given tokenizer, which replaces the trained one)."""
    h = hashlib.sha256()
    for path in corpus_files(config.corpus):
        h.update(path.read_bytes())
    h.update(f"{config.vocab_size}/{config.val_fraction}/{config.shard_tokens}".encode())
    if any(p.name.endswith((".jsonl", ".jsonl.gz")) for p in corpus_files(config.corpus)):
        h.update(config.text_fields.encode())
    if tokenizer_json is not None:
        h.update(b"tokenizer:" + tokenizer_json.encode())
    return h.hexdigest()[:16]


def train_tokenizer(text: str, vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 style): every byte is a symbol, so no text is out of vocabulary."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    return tok


def _write_shards(tokens: npt.NDArray[np.uint16], out: Path, shard_tokens: int, chars: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    shards = []
    for i, start in enumerate(range(0, len(tokens), shard_tokens)):
        name = f"tokens-{i:05d}.bin"
        part = tokens[start : start + shard_tokens]
        mm = np.memmap(out / name, dtype=np.uint16, mode="w+", shape=(len(part),))
        mm[:] = part
        mm.flush()
        del mm
        shards.append(
            {"file": name, "tokens": len(part), "sha256": hashlib.sha256(part.tobytes()).hexdigest()}
        )
    index = {"dtype": "uint16", "total_tokens": len(tokens), "chars": chars, "shards": shards}
    tmp = out / f"{INDEX_FILE}.tmp"
    tmp.write_text(json.dumps(index, indent=1))
    os.replace(tmp, out / INDEX_FILE)  # the index is written last: a split without it is incomplete


@dataclass(frozen=True)
class PreparedData:
    """Where a prepared corpus lives and what it holds."""

    root: Path
    data_hash: str

    @property
    def tokenizer_path(self) -> Path:
        return self.root / TOKENIZER_FILE

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_file(str(self.tokenizer_path))

    def split(self, name: str) -> TokenShards:
        return TokenShards(self.root / name)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer().get_vocab_size()


def prepare(config: DataConfig, cache_dir: Path, tokenizer_json: str | None = None) -> PreparedData:
    """Tokenise the corpus into ``cache_dir/<data hash>/`` unless it is already there.

    1. hash the corpus and config; reuse a complete earlier preparation;
    2. train the byte-level BPE on the whole corpus (or take ``tokenizer_json``, a parent
       model's tokenizer) and save ``tokenizer.json``;
    3. split the text, encode each split, and write its shards, index last.

    Steps 2 and 3 write into a folder of this call's own, renamed to ``<data hash>`` when
    complete: jobs that share a cache (sweep trials on one node) and prepare the same corpus at
    once never write into each other's files or read a half-written one; the first rename wins.
    """
    # 1. Reuse.
    digest = data_hash(config, tokenizer_json)
    root = cache_dir / digest
    if _complete(root):
        return PreparedData(root, digest)
    cache_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{digest}.", dir=cache_dir))
    try:
        # 2. Tokenizer.
        text = read_corpus(config)
        tok = (
            Tokenizer.from_str(tokenizer_json) if tokenizer_json else train_tokenizer(text, config.vocab_size)
        )
        if tok.get_vocab_size() > 65535:
            raise ValueError(f"a vocabulary of {tok.get_vocab_size()} does not fit uint16 shards")
        tok.save(str(work / TOKENIZER_FILE))
        # 3. Splits.
        cut = int(len(text) * (1.0 - config.val_fraction))
        for name, part in (("train", text[:cut]), ("val", text[cut:])):
            ids = np.asarray(tok.encode(part).ids, dtype=np.uint16)
            _write_shards(ids, work / name, config.shard_tokens, chars=len(part))
        _publish(work, root)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return PreparedData(root, digest)


def _complete(root: Path) -> bool:
    return (
        all((root / s / INDEX_FILE).exists() for s in ("train", "val")) and (root / TOKENIZER_FILE).exists()
    )


def _publish(work: Path, root: Path) -> None:
    """Rename the finished ``work`` folder to ``root``; when another preparation got there first,
    keep its (identical) result; an incomplete ``root`` (a crash mid-way, before preparations
    were renamed into place) is replaced."""
    try:
        os.rename(work, root)
        return
    except OSError:
        if _complete(root):
            return
    shutil.rmtree(root, ignore_errors=True)
    try:
        os.rename(work, root)
    except OSError:
        if not _complete(root):
            raise


class TokenShards:
    """A read-only view over a split's memmap shards as one token sequence."""

    def __init__(self, root: Path) -> None:
        index = json.loads((root / INDEX_FILE).read_text())
        self.chars: int = index["chars"]
        self.total_tokens: int = index["total_tokens"]
        self._shards = [np.memmap(root / s["file"], dtype=np.uint16, mode="r") for s in index["shards"]]
        self._starts = np.cumsum([0] + [len(s) for s in self._shards])

    @property
    def chars_per_token(self) -> float:
        return self.chars / max(1, self.total_tokens)

    def read(self, offset: int, length: int) -> npt.NDArray[np.int64]:
        """``length`` tokens from ``offset``, across shard boundaries."""
        if offset < 0 or offset + length > self.total_tokens:
            raise IndexError(f"tokens [{offset}, {offset + length}) outside [0, {self.total_tokens})")
        out = np.empty(length, dtype=np.int64)
        filled = 0
        shard = int(np.searchsorted(self._starts, offset, side="right")) - 1
        while filled < length:
            local = offset + filled - int(self._starts[shard])
            take = min(length - filled, len(self._shards[shard]) - local)
            out[filled : filled + take] = self._shards[shard][local : local + take]
            filled += take
            shard += 1
        return out

    def num_windows(self, seq_len: int) -> int:
        """Non-overlapping windows of ``seq_len`` inputs (+1 target token) in the split."""
        return max(0, (self.total_tokens - 1) // seq_len)

    def window(self, index: int, seq_len: int) -> npt.NDArray[np.int64]:
        return self.read(index * seq_len, seq_len + 1)


@dataclass
class SamplerState:
    """Position in the global sample order; saved in every checkpoint."""

    epoch: int = 0
    cursor: int = 0


class StepSampler:
    """Each optimizer step takes the next ``global_batch`` windows of the epoch's permutation;
    rank ``r`` of ``w`` reads the ``r``-th contiguous slice of them. An epoch ends when fewer
    than ``global_batch`` windows are left; the next one is a fresh permutation."""

    def __init__(
        self, num_windows: int, global_batch: int, seed: int, state: SamplerState | None = None
    ) -> None:
        if num_windows < global_batch:
            raise ValueError(
                f"the split has {num_windows} windows, fewer than one global batch ({global_batch})"
            )
        self.num_windows = num_windows
        self.global_batch = global_batch
        self.seed = seed
        self.state = state or SamplerState()
        self._perm_epoch = -1
        self._perm: npt.NDArray[np.int64] = np.empty(0, dtype=np.int64)

    def _permutation(self, epoch: int) -> npt.NDArray[np.int64]:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            self._perm_epoch = epoch
        return self._perm

    def next_step(self, rank: int, world_size: int) -> list[int]:
        """Window indices this rank trains on in the next step; advances the global position."""
        if self.state.cursor + self.global_batch > self.num_windows:
            self.state = SamplerState(epoch=self.state.epoch + 1, cursor=0)
        perm = self._permutation(self.state.epoch)
        per_rank = self.global_batch // world_size
        start = self.state.cursor + rank * per_rank
        self.state = SamplerState(self.state.epoch, self.state.cursor + self.global_batch)
        return [int(i) for i in perm[start : start + per_rank]]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.state.epoch, "cursor": self.state.cursor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = SamplerState(int(state["epoch"]), int(state["cursor"]))


class MixtureSampler:
    """A global batch whose every slot comes from source ``s`` with probability ``weights[s]``.

    The slot's source is drawn by a generator seeded with (seed, step), so the realised mixture
    depends only on the seed; each source hands out its windows in its own per-epoch permutation
    (seeded by seed, source, epoch), starting a new epoch when it runs out. State: the step and
    each source's (epoch, cursor) — a position in the global order, exact for any world size.
    Rank ``r`` of ``w`` takes the ``r``-th contiguous slice of the global batch.
    """

    _SOURCE_STREAM = 0x5EED

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], global_batch: int, seed: int) -> None:
        if len(sizes) != len(weights) or not sizes:
            raise ValueError("one weight per source")
        if any(n <= 0 for n in sizes):
            raise ValueError(f"every source needs at least one window, got {list(sizes)}")
        total = float(sum(weights))
        self.sizes = [int(n) for n in sizes]
        self.weights = [float(w) / total for w in weights]
        self.global_batch = global_batch
        self.seed = seed
        self.step = 0
        self.cursors = [[0, 0] for _ in sizes]  # [epoch, cursor] per source
        self._perms: dict[tuple[int, int], npt.NDArray[np.int64]] = {}

    def _take(self, source: int) -> int:
        epoch, cursor = self.cursors[source]
        if cursor >= self.sizes[source]:
            epoch, cursor = epoch + 1, 0
        key = (source, epoch)
        if key not in self._perms:
            self._perms = {k: v for k, v in self._perms.items() if k[0] != source}
            self._perms[key] = np.random.default_rng([self.seed, source, epoch]).permutation(
                self.sizes[source]
            )
        self.cursors[source] = [epoch, cursor + 1]
        return int(self._perms[key][cursor])

    def next_step(self, rank: int, world_size: int) -> list[tuple[int, int]]:
        """(source, window) pairs this rank trains on in the next step; advances the global position."""
        rng = np.random.default_rng([self.seed, self._SOURCE_STREAM, self.step])
        sources = rng.choice(len(self.sizes), size=self.global_batch, p=self.weights)
        batch = [(int(s), self._take(int(s))) for s in sources]
        self.step += 1
        per_rank = self.global_batch // world_size
        return batch[rank * per_rank : (rank + 1) * per_rank]

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "cursors": [list(c) for c in self.cursors]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        cursors = [[int(e), int(c)] for e, c in state["cursors"]]
        if len(cursors) != len(self.sizes):
            raise ValueError(
                f"the checkpoint's mixture has {len(cursors)} sources, this run {len(self.sizes)}"
            )
        self.step, self.cursors = int(state["step"]), cursors
