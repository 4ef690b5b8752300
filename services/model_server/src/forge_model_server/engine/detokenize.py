"""Each token's share of the decoded text, as vLLM's incremental detokenizer gives it.

A byte-level tokenizer may split one character over several tokens (``−``, U+2212, is three byte
tokens): decoded alone, each of them is ``\\ufffd``, and offsets counted from those pieces drift
by two characters per such character. Here a token whose bytes end inside a character adds
``""`` and the token that completes it adds the whole character, so the pieces of a sequence
join to its decoded text and ``text_offset`` (the running sum of their lengths) points at real
characters of the returned text.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

Decode = Callable[[list[int]], str]

_INCOMPLETE = "\ufffd"


class IncrementalDecoder:
    """Feed token ids one at a time; :meth:`push` returns the text each one completes.

    The window (``_prefix`` … end) is decoded against its emitted part (``_prefix`` … ``_read``)
    so a token's text is read in context (vLLM's ``detokenize_incrementally``) without decoding
    the whole sequence each step.
    """

    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token_id: int) -> str:
        """The text ``token_id`` completes: ``""`` while a character is still unfinished."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or after.endswith(_INCOMPLETE):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]

    def flush(self) -> str:
        """The text of ids still held back (bytes that never finish a character decode as
        ``\\ufffd``, as the whole sequence decodes them); the decoder is then fully read."""
        if self._read == len(self._ids):
            return ""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return after[len(before) :]


def token_pieces(decode: Decode, ids: Iterable[int]) -> list[str]:
    """Per token of ``ids``, the text it adds; they join to ``decode(ids)`` (a held-back tail is
    given to the last token)."""
    decoder = IncrementalDecoder(decode)
    pieces = [decoder.push(token_id) for token_id in ids]
    if pieces:
        pieces[-1] += decoder.flush()
    return pieces
