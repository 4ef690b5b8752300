"""The BM25 sparse encoder of the index (chunking is ``chunking.py``).

Sparse vectors are Qdrant's own BM25 (``qdrant_edge.Bm25``, the embedder Qdrant Edge ships, whose
configuration mirrors the server's ``Bm25Config``): words lowercased, the language's stop words
dropped and the rest Snowball-stemmed, each term hashed to a stable dimension; a document's value
for a term is its BM25 term-frequency part, ``tf·(k1+1) / (tf + k1·(1 − b + b·len/avg_len))``; a
query has weight 1 per distinct term; the IDF part is applied by Qdrant at search time (the
``Idf`` modifier of the sparse vector), so it always reflects the collection as it is now.
Stemming and stop words were worth +0.03 nDCG@10 on SciFact and +0.02 on NFCorpus over plain
lowercase words (``load/retrieval/RESULTS.md``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import qdrant_edge as qe

#: Encoded to fingerprint an encoder: a library release that tokenises, stems or hashes differently
#: changes the fingerprint, and indexes built with the old vectors are rebuilt, not searched.
_PROBE = "Tumour-suppressing genes were studied in 12 glioblastoma cell lines; TNFAIP3 expression rose."


@dataclass(frozen=True)
class SparseVector:
    """Parallel lists of dimensions (ascending, distinct) and their values."""

    indices: tuple[int, ...]
    values: tuple[float, ...]

    def __len__(self) -> int:
        return len(self.indices)


class Bm25Encoder:
    """Turns chunk text into BM25-weighted sparse vectors and queries into term sets.

    ``language`` picks the stop words and the Snowball stemmer (any language Qdrant's BM25
    supports, e.g. ``english``, ``german``); ``none`` keeps every word unstemmed. Refuses an unknown
    language or out-of-range parameters with ``ValueError``.
    """

    def __init__(
        self, k1: float = 1.2, b: float = 0.75, avg_len: float = 180.0, language: str = "english"
    ) -> None:
        if k1 < 0 or not 0 <= b <= 1 or avg_len <= 0:
            raise ValueError(f"need k1 >= 0, 0 <= b <= 1, avg_len > 0; got {k1=} {b=} {avg_len=}")
        language = language.strip().lower()
        neutral = {"stopwords": qe.StopwordsSet(), "stemmer": qe.DisabledStemmer()}
        try:
            self._model = qe.Bm25(
                qe.Bm25Config(
                    k=k1, b=b, avg_len=avg_len, **(neutral if language == "none" else {"language": language})
                )
            )
        except ValueError as exc:
            raise ValueError(f"BM25 language {language!r}: {exc}") from exc
        self.k1, self.b, self.avg_len, self.language = k1, b, avg_len, language
        probe = self._model.embed_document(_PROBE)
        fingerprint = json.dumps([k1, b, avg_len, language, list(probe.indices), list(probe.values)])
        self.version = "qdrant-bm25:" + hashlib.sha256(fingerprint.encode()).hexdigest()[:16]
        """Identifies the vectors this encoder makes; indexes record it and rebuild on a change."""

    def encode_document(self, text: str) -> SparseVector:
        return self._sparse(self._model.embed_document(text))

    def encode_query(self, text: str) -> SparseVector:
        return self._sparse(self._model.embed_query(text))

    @staticmethod
    def _sparse(vector: qe.SparseVector) -> SparseVector:
        pairs = sorted(zip(vector.indices, vector.values, strict=True))
        return SparseVector(tuple(i for i, _ in pairs), tuple(float(v) for _, v in pairs))
