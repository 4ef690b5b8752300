"""The chunker and the BM25 sparse encoder."""

from __future__ import annotations

import hashlib

import pytest

from forge_retriever.text import Bm25Encoder, chunk_words, term_index, tokenize


def test_chunks_are_windows_with_overlap_covering_every_word() -> None:
    text = " ".join(f"w{i}" for i in range(25))
    chunks = chunk_words(text, window=10, overlap=3)
    assert [c.text.split()[0] for c in chunks] == ["w0", "w7", "w14", "w21"]
    assert [len(c.text.split()) for c in chunks] == [10, 10, 10, 4]  # the last window ends at the last word
    assert chunks[1].text.split()[:3] == chunks[0].text.split()[-3:]
    assert chunks[-1].text.endswith("w24")
    assert [c.index for c in chunks] == [0, 1, 2, 3]


def test_chunk_is_a_slice_of_the_original_text() -> None:
    text = "Alpha,  beta\n\ngamma.\tdelta epsilon"
    chunks = chunk_words(text, window=3, overlap=1)
    for chunk in chunks:
        assert text[chunk.start : chunk.end] == chunk.text
    assert chunks[0].text == "Alpha,  beta\n\ngamma."


def test_short_and_empty_text() -> None:
    assert [c.text for c in chunk_words("just three words", window=10, overlap=2)] == ["just three words"]
    assert chunk_words("   \n ", window=10, overlap=2) == []


@pytest.mark.parametrize(("window", "overlap"), [(0, 0), (5, 5), (5, -1)])
def test_bad_window_is_rejected(window: int, overlap: int) -> None:
    with pytest.raises(ValueError):
        chunk_words("a b c", window=window, overlap=overlap)


def test_tokens_are_lowercase_words() -> None:
    assert tokenize("TNFAIP3 is a Tumor-suppressor, in glioblastoma!") == [
        "tnfaip3",
        "is",
        "a",
        "tumor",
        "suppressor",
        "in",
        "glioblastoma",
    ]


def test_term_index_is_stable_and_31_bit() -> None:
    # Fixed values: a change of hash would silently invalidate every persisted index.
    assert term_index("protein") == term_index("protein")
    assert term_index("protein") != term_index("proteins")
    assert all(0 <= term_index(t) < 2**31 for t in ["a", "glioblastoma", "ß", "x" * 500])
    assert term_index("cell") == 0x7FFFFFFF & int.from_bytes(
        hashlib.blake2b(b"cell", digest_size=4).digest(), "big"
    )


def test_document_vector_has_bm25_saturation_and_length_normalisation() -> None:
    enc = Bm25Encoder(k1=1.2, b=0.75, avg_len=4)
    vec = enc.encode_document("cell cell cell growth")
    weights = dict(zip(vec.indices, vec.values, strict=True))
    norm = 1.2 * (1 - 0.75 + 0.75 * 4 / 4)
    assert weights[term_index("cell")] == pytest.approx(3 * 2.2 / (3 + norm))
    assert weights[term_index("growth")] == pytest.approx(1 * 2.2 / (1 + norm))
    assert list(vec.indices) == sorted(vec.indices)
    # Saturation: three occurrences weigh less than three times one.
    assert weights[term_index("cell")] < 3 * weights[term_index("growth")]
    # A longer document gets a smaller weight for the same term frequency.
    long_vec = enc.encode_document("growth " + "x " * 20)
    longer = dict(zip(long_vec.indices, long_vec.values, strict=True))
    assert longer[term_index("growth")] < weights[term_index("growth")]


def test_query_vector_weights_each_distinct_term_once() -> None:
    vec = Bm25Encoder().encode_query("Cell cell growth")
    assert sorted(vec.indices) == sorted({term_index("cell"), term_index("growth")})
    assert set(vec.values) == {1.0}
    assert len(Bm25Encoder().encode_query("!!! ...")) == 0
