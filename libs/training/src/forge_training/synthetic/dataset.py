"""Writing the kept problems as a versioned data set.

``write_dataset(out, items, lineage, tokenizer=...)`` writes, into ``out``:

- ``problems.jsonl``: each kept problem (``Problem.to_json``) with its verified ``answer`` and the
  solutions that agree with it;
- ``sft.jsonl``: what the ``sft`` task reads (``pairs.path``): HH-RLHF transcripts
  ``{"chosen": "\\n\\nHuman: <question>\\n\\nAssistant: <solution>", "rejected": ...}``, the
  solution without calculator annotations. The ``sft`` task trains on ``chosen`` only, but drops
  pairs whose two responses are equal, so ``rejected`` is a solution the verifier rejected when
  the problem has one, else the chosen solution with its ``####`` answer changed (a DPO run could
  read the same file);
- ``tokens/``: the chosen conversations in the chat template (``User: …`` / ``Assistant: …`` and
  end-of-text), tokenised with the given tokenizer, as ``uint16`` shards with ``index.json``
  (:mod:`forge_training.data`'s shard format);
- ``lineage.json`` (written last): the content hash (sha256 of ``problems.jsonl``, which is a
  pure function of the kept problems and their order), each file's sha256, and the caller's
  lineage (teacher, templates, seed, filters, counts at every stage).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from forge_training.data import EOT, INDEX_FILE, _write_shards
from forge_training.pairs import render
from forge_training.synthetic.problems import format_number
from forge_training.synthetic.verify import Verified, final_answer, parse_answer

LINEAGE_FILE = "lineage.json"
SHARD_TOKENS = 1 << 20


def problem_record(item: Verified) -> dict[str, Any]:
    row = item.problem.to_json()
    row["answer"] = item.answer
    row["kept_solutions"] = [s.text for s in item.solutions]
    return row


def problems_jsonl(items: Sequence[Verified]) -> str:
    return "".join(json.dumps(problem_record(v), sort_keys=True) + "\n" for v in items)


def content_hash(items: Sequence[Verified]) -> str:
    """sha256 of the kept problems as written to ``problems.jsonl``."""
    return hashlib.sha256(problems_jsonl(items).encode()).hexdigest()


def _changed_answer(text: str) -> str:
    raw = final_answer(text) or ""
    parsed = parse_answer(raw)
    wrong = "0"
    if parsed is not None and parsed.value.is_Rational:
        wrong = format_number(Fraction(int(parsed.value.p), int(parsed.value.q)) + 1)
    head = text.rsplit("####", 1)[0]
    return f"{head}#### {wrong}"


def _rejected(item: Verified) -> str:
    kept = {s.text for s in item.solutions}
    others = [s.plain() for s in item.problem.solutions if s.text not in kept]
    chosen = item.solutions[0].plain()
    return next((o for o in others if o.strip() and o.strip() != chosen.strip()), _changed_answer(chosen))


def _transcript(question: str, response: str) -> str:
    return f"\n\nHuman: {question}\n\nAssistant: {response}"


def sft_rows(items: Sequence[Verified], solutions_per_problem: int = 1) -> list[dict[str, str]]:
    """The ``sft`` task's rows: up to ``solutions_per_problem`` distinct kept solutions per problem."""
    rows = []
    for item in items:
        rejected = _rejected(item)
        seen: set[str] = set()
        for solution in item.solutions:
            text = solution.plain()
            if text in seen or len(seen) >= solutions_per_problem:
                continue
            seen.add(text)
            rows.append(
                {
                    "chosen": _transcript(item.problem.question, text),
                    "rejected": _transcript(item.problem.question, rejected),
                }
            )
    return rows


def chat_text(question: str, solution: str) -> str:
    """A conversation in the chat template, end-of-text included (what the student reads)."""
    return render(
        [{"role": "user", "content": question}, {"role": "assistant", "content": solution}], eos=EOT
    )


def _write(path: Path, text: str) -> str:
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class WrittenDataset:
    root: Path
    content_hash: str
    problems: int
    sft_rows: int
    tokens: int


def write_dataset(
    out: Path,
    items: Sequence[Verified],
    lineage: Mapping[str, Any],
    *,
    tokenizer: Tokenizer | None = None,
    solutions_per_problem: int = 1,
    shard_tokens: int = SHARD_TOKENS,
) -> WrittenDataset:
    """Write the data set (see the module docstring); ``lineage`` must be JSON-serialisable."""
    if not items:
        raise ValueError("no problems to write")
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}
    problems_text = problems_jsonl(items)
    files["problems.jsonl"] = _write(out / "problems.jsonl", problems_text)
    rows = sft_rows(items, solutions_per_problem)
    files["sft.jsonl"] = _write(
        out / "sft.jsonl", "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)
    )
    total = 0
    if tokenizer is not None:
        if tokenizer.get_vocab_size() > 65535:
            raise ValueError(f"a vocabulary of {tokenizer.get_vocab_size()} does not fit uint16 shards")
        texts = [chat_text(v.problem.question, v.solutions[0].plain()) for v in items]
        ids = np.asarray([t for enc in tokenizer.encode_batch(texts) for t in enc.ids], dtype=np.uint16)
        _write_shards(ids, out / "tokens", shard_tokens, chars=sum(len(t) for t in texts))
        total = len(ids)
        files["tokens/index.json"] = hashlib.sha256((out / "tokens" / INDEX_FILE).read_bytes()).hexdigest()
    record = {
        "content_hash": hashlib.sha256(problems_text.encode()).hexdigest(),
        "problems": len(items),
        "sft_rows": len(rows),
        "tokens": total,
        "files": files,
        **dict(lineage),
    }
    _write(out / LINEAGE_FILE, json.dumps(record, indent=2, sort_keys=True))
    return WrittenDataset(out, record["content_hash"], len(items), len(rows), total)
