"""Chunking by the embedding model's tokens along headings, paragraphs and sentences."""

from __future__ import annotations

import re

import pytest

from forge_retriever.chunking import HfTokenizer, TokenChunker
from forge_retriever.embed import bundled_minilm_path


class Words:
    """A tokenizer of whitespace-separated words: one token a word, easy to count by hand."""

    def token_spans(self, text: str) -> list[tuple[int, int]]:
        return [(m.start(), m.end()) for m in re.finditer(r"\S+", text)]


def words(n: int, tag: str) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def test_short_paragraphs_share_a_chunk_and_chunks_are_slices_of_the_text() -> None:
    text = "Alpha beta gamma.\n\nDelta epsilon zeta eta theta.\n\n\nIota kappa lambda mu."
    chunks = TokenChunker(Words(), max_tokens=8, overlap_tokens=0).chunk(text)
    assert [c.text for c in chunks] == [
        "Alpha beta gamma.\n\nDelta epsilon zeta eta theta.",
        "Iota kappa lambda mu.",
    ]
    for chunk in chunks:
        assert text[chunk.start : chunk.end] == chunk.text
    assert [c.index for c in chunks] == [0, 1]


def test_a_heading_opens_a_chunk_and_a_chunk_never_spans_two_sections() -> None:
    text = "Intro words here.\n\n# Methods\nWe measured things.\n\n## Results\nIt worked."
    chunks = TokenChunker(Words(), max_tokens=50, overlap_tokens=5).chunk(text)
    assert [c.text for c in chunks] == [
        "Intro words here.",
        "# Methods\nWe measured things.",
        "## Results\nIt worked.",
    ]


def test_a_long_paragraph_is_cut_at_sentences_with_whole_sentences_of_overlap() -> None:
    sentences = [f"{words(4, t)}." for t in "abcdef"]  # six sentences of four tokens
    text = " ".join(sentences)
    chunks = TokenChunker(Words(), max_tokens=9, overlap_tokens=4).chunk(text)
    # Two sentences fit a window; the next chunk repeats the last sentence (4 tokens of overlap).
    assert [c.text for c in chunks] == [
        f"{sentences[0]} {sentences[1]}",
        f"{sentences[1]} {sentences[2]}",
        f"{sentences[2]} {sentences[3]}",
        f"{sentences[3]} {sentences[4]}",
        f"{sentences[4]} {sentences[5]}",
    ]
    no_overlap = TokenChunker(Words(), max_tokens=9, overlap_tokens=0).chunk(text)
    assert len(no_overlap) == 3 and " ".join(c.text for c in no_overlap) == text


def test_a_sentence_longer_than_the_window_is_cut_into_token_windows() -> None:
    text = words(25, "w")
    chunks = TokenChunker(Words(), max_tokens=10, overlap_tokens=3).chunk(text)
    assert [c.text.split()[0] for c in chunks] == ["w0", "w7", "w14", "w21"]
    assert [len(c.text.split()) for c in chunks] == [10, 10, 10, 4]  # the last window ends at the last word
    assert chunks[1].text.split()[:3] == chunks[0].text.split()[-3:]
    covered = {w for c in chunks for w in c.text.split()}
    assert covered == set(text.split())


def test_empty_text_and_bad_windows() -> None:
    assert TokenChunker(Words(), 10, 2).chunk("   \n\n ") == []
    assert [c.text for c in TokenChunker(Words(), 10, 2).chunk("just three words")] == ["just three words"]
    for size, overlap in [(4, 0), (10, 10), (10, -1)]:
        with pytest.raises(ValueError):
            TokenChunker(Words(), size, overlap)


def test_windows_count_minilm_word_pieces() -> None:
    tokenizer = HfTokenizer(bundled_minilm_path())
    text = "Glioblastoma multiforme is immunosuppressive. " * 40
    chunks = TokenChunker(
        tokenizer, max_tokens=64, overlap_tokens=16, fingerprint=tokenizer.fingerprint
    ).chunk(text)
    assert len(chunks) > 1
    for chunk in chunks:
        assert len(tokenizer.token_spans(chunk.text)) <= 64
        assert chunk.text.endswith(".")  # cut at sentence ends, the sentences being short
    assert (
        TokenChunker(tokenizer, 64, 16, tokenizer.fingerprint).version
        != TokenChunker(tokenizer, 64, 8).version
    )
