"""Chunking by tokens of the embedding model's tokenizer, along the document's own structure.

:meth:`TokenChunker.chunk` runs these steps:

1. tokenize the whole text once (character offsets of every token), so any span's length in
   tokens is two bisections;
2. cut the text into **sections** at Markdown headings (a line of 1-6 ``#``), each heading opening
   its section, and sections into **paragraphs** at blank lines;
3. a paragraph longer than the window is cut into sentences, and a sentence longer than the
   window into windows of tokens;
4. pack consecutive pieces of one section into chunks of at most ``max_tokens`` tokens — a chunk
   never spans two sections and cuts a paragraph only where it does not fit whole; the next chunk
   of the same section starts again with the last whole pieces of the previous one that fit in
   ``overlap_tokens``.

Chunks are slices of the original text (``start``/``end`` character offsets). The window counts
the chunk's own tokens; the retriever adds the title when it embeds a chunk, so a window a little
under the embedding model's length leaves room for it.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

_HEADING = re.compile(r"^[ \t]{0,3}#{1,6}[ \t]+\S.*$", re.MULTILINE)
_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n\s*")
# A sentence ends at . ! or ? (closing quotes and brackets kept) before whitespace.
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s+")


@dataclass(frozen=True)
class Chunk:
    """A piece of a document; ``start``/``end`` are character offsets into its text."""

    index: int
    text: str
    start: int
    end: int


class Offsets(Protocol):
    """What :class:`TokenChunker` needs of a tokenizer: each token's character span."""

    def token_spans(self, text: str) -> list[tuple[int, int]]:
        """``(start, end)`` of every token of ``text``, in order, special tokens excluded."""


class HfTokenizer:
    """:class:`Offsets` of a Hugging Face fast tokenizer (a model folder's ``tokenizer.json``)."""

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(str(model_dir)).backend_tokenizer
        # A model's tokenizer.json may pad and truncate (MiniLM's pads to 128): counting needs neither.
        self._tokenizer.no_padding()
        self._tokenizer.no_truncation()
        self.name = Path(model_dir).name
        self.fingerprint = hashlib.sha256(self._tokenizer.to_str().encode()).hexdigest()[:16]

    def token_spans(self, text: str) -> list[tuple[int, int]]:
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return [(start, end) for start, end in encoding.offsets]


class TokenChunker:
    """Chunks of at most ``max_tokens`` tokens of ``tokenizer`` sharing up to ``overlap_tokens``
    (the module docstring has the steps). ``version`` identifies the chunking: documents are
    rewritten when it changes even if their content did not."""

    def __init__(
        self, tokenizer: Offsets, max_tokens: int, overlap_tokens: int, fingerprint: str = ""
    ) -> None:
        if max_tokens < 8 or not 0 <= overlap_tokens < max_tokens:
            raise ValueError(
                f"need max_tokens >= 8 and 0 <= overlap_tokens < max_tokens, got {max_tokens=} {overlap_tokens=}"
            )
        self._tokenizer = tokenizer
        self.max_tokens, self.overlap_tokens = max_tokens, overlap_tokens
        self.version = f"tokens:{max_tokens}:{overlap_tokens}:{fingerprint}"

    def chunk(self, text: str) -> list[Chunk]:
        # 1. Tokens once, with offsets.
        spans = self._tokenizer.token_spans(text)
        starts = [s for s, _ in spans]
        ends = [e for _, e in spans]

        def tokens(start: int, end: int) -> int:
            return bisect.bisect_left(starts, end) - bisect.bisect_left(ends, start + 1)

        chunks: list[Chunk] = []
        # 2. Sections and paragraphs.
        for section in _sections(text):
            pieces: list[tuple[int, int]] = []
            for paragraph in _split(text, section, _PARAGRAPH_BREAK):
                # 3. What does not fit whole is cut finer.
                pieces += self._fitting(text, paragraph, tokens, starts, ends)
            # 4. Pack.
            self._pack(text, pieces, tokens, chunks)
        return chunks

    def _fitting(
        self,
        text: str,
        span: tuple[int, int],
        tokens: _Counter,
        starts: list[int],
        ends: list[int],
    ) -> list[tuple[int, int]]:
        if tokens(*span) <= self.max_tokens:
            return [span]
        out: list[tuple[int, int]] = []
        for sentence in _split(text, span, _SENTENCE_END, keep_separator=True):
            if tokens(*sentence) <= self.max_tokens:
                out.append(sentence)
                continue
            # A sentence longer than the window: windows of tokens, sharing the overlap.
            first = bisect.bisect_left(ends, sentence[0] + 1)
            last = bisect.bisect_left(starts, sentence[1])
            step = self.max_tokens - self.overlap_tokens
            for i in range(first, last, step):
                j = min(i + self.max_tokens, last)
                out.append((starts[i], ends[j - 1]))
                if j == last:
                    break
        return out

    def _pack(self, text: str, pieces: list[tuple[int, int]], tokens: _Counter, chunks: list[Chunk]) -> None:
        current: list[tuple[int, int]] = []
        for piece in pieces:
            if current and tokens(current[0][0], piece[1]) > self.max_tokens:
                chunks.append(_chunk(text, current, len(chunks)))
                current = self._overlap(current, piece, tokens)
            current.append(piece)
        if current:
            chunks.append(_chunk(text, current, len(chunks)))

    def _overlap(
        self, previous: list[tuple[int, int]], piece: tuple[int, int], tokens: _Counter
    ) -> list[tuple[int, int]]:
        """The last whole pieces of ``previous`` (never all of it) that fit in the overlap and
        still leave room for ``piece``."""
        kept: list[tuple[int, int]] = []
        for candidate in reversed(previous[1:]):
            start = candidate[0]
            if (
                tokens(start, previous[-1][1]) > self.overlap_tokens
                or tokens(start, piece[1]) > self.max_tokens
            ):
                break
            kept.insert(0, candidate)
        return kept


class _Counter(Protocol):
    def __call__(self, start: int, end: int) -> int: ...


def _sections(text: str) -> list[tuple[int, int]]:
    cuts = [m.start() for m in _HEADING.finditer(text)]
    bounds = [0, *[c for c in cuts if c > 0], len(text)]
    return [(a, b) for a, b in itertools.pairwise(bounds) if text[a:b].strip()]


def _split(
    text: str, span: tuple[int, int], separator: re.Pattern[str], *, keep_separator: bool = False
) -> list[tuple[int, int]]:
    """Non-blank parts of ``text[span]`` between matches of ``separator``, trimmed of whitespace
    (``keep_separator``: the separator's non-space characters stay with the part before it)."""
    start, end = span
    parts, at = [], start
    for match in separator.finditer(text, start, end):
        cut = match.start() + len(match.group().rstrip()) if keep_separator else match.start()
        parts.append((at, cut))
        at = match.end()
    parts.append((at, end))
    out = []
    for a, b in parts:
        piece = text[a:b]
        stripped = piece.strip()
        if stripped:
            lead = len(piece) - len(piece.lstrip())
            out.append((a + lead, a + lead + len(stripped)))
    return out


def _chunk(text: str, pieces: list[tuple[int, int]], index: int) -> Chunk:
    start, end = pieces[0][0], pieces[-1][1]
    return Chunk(index=index, text=text[start:end], start=start, end=end)
