"""Tokenizer and data pipeline: byte-level BPE, memory-mapped token shards, a resumable sampler.

:func:`prepare` trains the tokenizer on the corpus, splits the text (the last ``val_fraction``
for validation, as nanoGPT does), and writes each split as ``uint16`` shard files with an
``index.json`` (shard sizes and sha256), like Megatron's ``MMapIndexedDataset``. The result is
keyed by a hash of the corpus and the data config, so a second run reuses it.

:class:`StepSampler` decides which windows each rank reads. Its order depends only on the seed
and the epoch, and its state is one position in the *global* order (epoch, cursor), so a resumed
run reads exactly what the uninterrupted one would have read — with any world size.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from forge_trainer_agent.training.recipes import DataConfig, corpus_files

TOKENIZER_FILE = "tokenizer.json"
INDEX_FILE = "index.json"
#: End-of-text token (also used as BOS/EOS/PAD in the exported tokenizer).
EOT = "<|endoftext|>"


def read_corpus(config: DataConfig) -> str:
    return "".join(p.read_text(encoding="utf-8") for p in corpus_files(config.corpus))


def data_hash(config: DataConfig) -> str:
    """Hash of the corpus bytes and every setting that changes the token shards."""
    h = hashlib.sha256()
    for path in corpus_files(config.corpus):
        h.update(path.read_bytes())
    h.update(f"{config.vocab_size}/{config.val_fraction}/{config.shard_tokens}".encode())
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


def prepare(config: DataConfig, cache_dir: Path) -> PreparedData:
    """Tokenise the corpus into ``cache_dir/<data hash>/`` unless it is already there.

    1. hash the corpus and config; reuse a complete earlier preparation;
    2. train the byte-level BPE on the whole corpus and save ``tokenizer.json``;
    3. split the text, encode each split, and write its shards, index last.
    """
    # 1. Reuse.
    digest = data_hash(config)
    root = cache_dir / digest
    if all((root / s / INDEX_FILE).exists() for s in ("train", "val")) and (root / TOKENIZER_FILE).exists():
        return PreparedData(root, digest)
    root.mkdir(parents=True, exist_ok=True)
    # 2. Tokenizer.
    text = read_corpus(config)
    tok = train_tokenizer(text, config.vocab_size)
    tok.save(str(root / f"{TOKENIZER_FILE}.tmp"))
    os.replace(root / f"{TOKENIZER_FILE}.tmp", root / TOKENIZER_FILE)
    # 3. Splits.
    cut = int(len(text) * (1.0 - config.val_fraction))
    for name, part in (("train", text[:cut]), ("val", text[cut:])):
        ids = np.asarray(tok.encode(part).ids, dtype=np.uint16)
        _write_shards(ids, root / name, config.shard_tokens, chars=len(part))
    return PreparedData(root, digest)


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
