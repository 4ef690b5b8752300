"""Text processing for the index: the word-window chunker and the BM25 sparse encoder.

Sparse vectors follow Qdrant's BM25 recipe: a document's value for a term is its BM25
term-frequency part, ``tf·(k1+1) / (tf + k1·(1 − b + b·len/avg_len))``; a query has weight 1 per
distinct term; the IDF part is applied by Qdrant at search time (the ``Idf`` modifier of the
sparse vector), so it always reflects the collection as it is now. Terms are lowercase word tokens
hashed to a stable index: the same word maps to the same dimension in every process and release.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from dataclasses import dataclass

_WORD = re.compile(r"\w+")
_NON_SPACE = re.compile(r"\S+")
_INDEX_MASK = 0x7FFF_FFFF  # 2^31 dimensions: Qdrant's sparse indices are u32; keep clear of the top bit


@dataclass(frozen=True)
class Chunk:
    """A window of a document's words; ``start``/``end`` are character offsets into its text."""

    index: int
    text: str
    start: int
    end: int


def chunk_words(text: str, window: int, overlap: int) -> list[Chunk]:
    """Split ``text`` into windows of ``window`` words, consecutive windows sharing ``overlap``.

    Chunks are slices of the original text (whitespace and punctuation kept). The last window ends
    at the last word, so every word is in at least one chunk and no chunk is a pure repeat.
    """
    if window < 1 or not 0 <= overlap < window:
        raise ValueError(f"need window >= 1 and 0 <= overlap < window, got {window=} {overlap=}")
    spans = [(m.start(), m.end()) for m in _NON_SPACE.finditer(text)]
    chunks: list[Chunk] = []
    step = window - overlap
    first = 0
    while first < len(spans):
        last = min(first + window, len(spans)) - 1
        start, end = spans[first][0], spans[last][1]
        chunks.append(Chunk(index=len(chunks), text=text[start:end], start=start, end=end))
        if last == len(spans) - 1:
            break
        first += step
    return chunks


def tokenize(text: str) -> list[str]:
    """Lowercase word tokens (Unicode letters, digits and underscore)."""
    return _WORD.findall(text.lower())


def term_index(token: str) -> int:
    """The sparse dimension of ``token``: the first 4 bytes of its BLAKE2b digest, 31 bits."""
    digest = hashlib.blake2b(token.encode("utf-8"), digest_size=4).digest()
    return int.from_bytes(digest, "big") & _INDEX_MASK


@dataclass(frozen=True)
class SparseVector:
    """Parallel lists of dimensions (ascending, distinct) and their values."""

    indices: tuple[int, ...]
    values: tuple[float, ...]

    def __len__(self) -> int:
        return len(self.indices)


class Bm25Encoder:
    """Turns chunk text into BM25-weighted sparse vectors and queries into term sets."""

    def __init__(self, k1: float = 1.2, b: float = 0.75, avg_len: float = 180.0) -> None:
        if k1 < 0 or not 0 <= b <= 1 or avg_len <= 0:
            raise ValueError(f"need k1 >= 0, 0 <= b <= 1, avg_len > 0; got {k1=} {b=} {avg_len=}")
        self.k1, self.b, self.avg_len = k1, b, avg_len

    def encode_document(self, text: str) -> SparseVector:
        tokens = tokenize(text)
        if not tokens:
            return SparseVector((), ())
        norm = self.k1 * (1.0 - self.b + self.b * len(tokens) / self.avg_len)
        counts = Counter(term_index(t) for t in tokens)
        indices = sorted(counts)
        values = tuple(counts[i] * (self.k1 + 1.0) / (counts[i] + norm) for i in indices)
        return SparseVector(tuple(indices), values)

    def encode_query(self, text: str) -> SparseVector:
        indices = sorted({term_index(t) for t in tokenize(text)})
        return SparseVector(tuple(indices), tuple(1.0 for _ in indices))
