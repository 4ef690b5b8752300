"""The BM25 sparse encoder."""

from __future__ import annotations

import pytest

from forge_retriever.text import Bm25Encoder


def test_documents_and_queries_meet_on_stems_without_stop_words() -> None:
    enc = Bm25Encoder()
    doc = enc.encode_document("The tumours were suppressed")
    query = enc.encode_query("tumour suppression")
    assert set(query.indices) <= set(doc.indices)  # plural and inflection stemmed away
    assert len(doc) == 2  # "the" and "were" are English stop words
    assert list(doc.indices) == sorted(doc.indices)
    assert len(enc.encode_query("!!! ...")) == 0 and len(enc.encode_query("the of and")) == 0


def test_language_none_keeps_every_word_unstemmed() -> None:
    enc = Bm25Encoder(language="none")
    assert len(enc.encode_document("The tumours were suppressed")) == 4
    assert set(enc.encode_query("tumour").indices).isdisjoint(enc.encode_query("tumours").indices)


def test_document_vector_has_bm25_saturation_and_length_normalisation() -> None:
    enc = Bm25Encoder(k1=1.2, b=0.75, avg_len=4, language="none")
    vec = enc.encode_document("cell cell cell growth")
    [growth] = enc.encode_query("growth").indices
    [cell] = enc.encode_query("cell").indices
    weights = dict(zip(vec.indices, vec.values, strict=True))
    norm = 1.2 * (1 - 0.75 + 0.75 * 4 / 4)
    assert weights[cell] == pytest.approx(3 * 2.2 / (3 + norm), rel=1e-6)
    assert weights[growth] == pytest.approx(1 * 2.2 / (1 + norm), rel=1e-6)
    # Saturation: three occurrences weigh less than three times one.
    assert weights[cell] < 3 * weights[growth]
    # A longer document gets a smaller weight for the same term frequency.
    longer = enc.encode_document("growth " + "x " * 20)
    assert dict(zip(longer.indices, longer.values, strict=True))[growth] < weights[growth]


def test_query_vector_weights_each_distinct_term_once() -> None:
    vec = Bm25Encoder().encode_query("Cell cell cells growth")
    assert len(vec) == 2 and set(vec.values) == {1.0}


def test_version_follows_the_vectors() -> None:
    """Indexes rebuild when it changes, so it must change with anything that changes a vector."""
    base = Bm25Encoder().version
    assert Bm25Encoder().version == base
    assert len({base, Bm25Encoder(k1=1.5).version, Bm25Encoder(language="none").version}) == 3
    assert Bm25Encoder(language="German").version == Bm25Encoder(language="german").version


def test_unknown_language_and_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="BM25 language 'klingon'"):
        Bm25Encoder(language="klingon")
    with pytest.raises(ValueError, match="need k1 >= 0"):
        Bm25Encoder(b=1.5)
