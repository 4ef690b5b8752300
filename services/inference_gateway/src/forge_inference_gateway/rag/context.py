"""Step 5 of a RAG request: the numbered passages and the prompt that holds them within a token
budget (:func:`assemble_context`), and which of them an answer cites (:func:`cited`)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from forge_inference_gateway.rag.clients import Candidate

_CITATION = re.compile(r"\[(\d+(?:\s*,\s*\d+)*)\]")
#: Overlap shorter than this many words is coincidence, not a shared chunk boundary.
_MIN_OVERLAP_WORDS = 5


@dataclass(frozen=True)
class Passage:
    """A chunk placed in the context as ``[n]``; ``text`` is what the model saw (overlap trimmed)."""

    n: int
    document_id: str
    chunk_id: str
    text: str
    score: float
    metadata: dict[str, str]

    def view(self) -> dict[str, object]:
        return {
            "n": self.n,
            "document_id": self.document_id,
            "chunk_id": self.chunk_id,
            "score": self.score,
            "metadata": self.metadata,
        }


def _trim_overlap(kept: str, text: str) -> str:
    """``text`` without the words it shares with ``kept`` at a chunk boundary (either side)."""
    a, b = kept.split(), text.split()
    for k in range(min(len(a), len(b)), _MIN_OVERLAP_WORDS - 1, -1):
        if a[-k:] == b[:k]:  # text continues kept
            return " ".join(b[k:])
        if b[-k:] == a[:k]:  # text leads into kept
            return " ".join(b[:-k])
    return text


PROMPT_HEAD = (
    "Answer the question using only the numbered passages. Cite the passages you use as [n]. "
    "If they do not contain the answer, say so.\n\n"
)


def render_prompt(query: str, passages: Sequence[tuple[int, str, str]]) -> str:
    """The user turn: instructions, ``[n] title: text`` per passage, then the question."""
    blocks = [f"[{n}] {title + ': ' if title else ''}{text}" for n, title, text in passages]
    return PROMPT_HEAD + "\n\n".join(blocks) + f"\n\nQuestion: {query}"


def assemble_context(
    query: str,
    ranked: Sequence[tuple[Candidate, float]],
    budget_tokens: int,
    count_tokens: Callable[[str], int],
) -> tuple[list[Passage], str]:
    """Numbered passages and the prompt that holds them, within ``budget_tokens``.

    1. In ranked order, drop a chunk already placed (same id or same text) or contained in a
       placed chunk, and trim the words a chunk shares with a placed chunk of the same document
       (neighbouring chunks overlap by design);
    2. add passages while the whole prompt stays within the budget; a passage that does not fit
       is skipped and smaller ones after it may still fit; the first passage is cut to fit rather
       than leaving the context empty.
    """
    placed: list[Passage] = []
    seen_ids: set[str] = set()
    for candidate, score in ranked:
        if candidate.chunk_id in seen_ids:
            continue
        text = " ".join(candidate.text.split())
        for p in placed:
            if text in p.text:
                text = ""
                break
            if p.document_id == candidate.document_id:
                text = _trim_overlap(p.text, text)
        if not text:
            continue
        title = candidate.metadata.get("title", "")
        trial = [(q.n, q.metadata.get("title", ""), q.text) for q in placed]
        trial.append((len(placed) + 1, title, text))
        if count_tokens(render_prompt(query, trial)) > budget_tokens:
            if placed:
                continue
            room = budget_tokens - count_tokens(render_prompt(query, [(1, title, "")]))
            if room <= 0:
                break
            words = text.split()
            while words and count_tokens(render_prompt(query, [(1, title, " ".join(words))])) > budget_tokens:
                words = words[: max(0, min(len(words) - 1, int(len(words) * 0.9)))]
            text = " ".join(words)
            if not text:
                break
        seen_ids.add(candidate.chunk_id)
        placed.append(
            Passage(
                len(placed) + 1, candidate.document_id, candidate.chunk_id, text, score, candidate.metadata
            )
        )
    prompt = render_prompt(query, [(p.n, p.metadata.get("title", ""), p.text) for p in placed])
    return placed, prompt


def cited(answer: str, passages: Sequence[Passage]) -> list[Passage]:
    """The passages ``answer`` cites as ``[n]`` or ``[n, m]``, in order of first citation."""
    by_n = {p.n: p for p in passages}
    out: list[Passage] = []
    for match in _CITATION.finditer(answer):
        for part in match.group(1).split(","):
            p = by_n.get(int(part))
            if p is not None and p not in out:
                out.append(p)
    return out
