"""The ``rag`` main-job step's sample and its refusal to run without a served model."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from forge_retriever.main_job import RagStepError, rag, sample


def _beir(folder: Path) -> Path:
    (folder / "qrels").mkdir(parents=True)
    docs = [{"_id": f"d{i}", "title": f"Title {i}", "text": f"text of document {i}"} for i in range(10)]
    (folder / "corpus.jsonl").write_text("\n".join(json.dumps(d) for d in docs))
    queries = [{"_id": "q1", "text": "first question"}, {"_id": "q2", "text": "second question"}]
    (folder / "queries.jsonl").write_text("\n".join(json.dumps(q) for q in queries))
    (folder / "qrels" / "test.tsv").write_text(
        "query-id\tcorpus-id\tscore\nq1\td7\t1\nq1\td8\t0\nq2\td9\t1\n"
    )
    return folder


def test_the_sample_holds_the_asked_questions_relevant_documents_first(tmp_path: Path) -> None:
    documents, question, relevant = sample(_beir(tmp_path / "beir"), queries=2, docs=4)
    assert question == "first question" and relevant == {"d7"}
    assert [d.id for d in documents] == ["d7", "d9", "d0", "d1"]


class _Ctx:
    def __init__(self, results: Mapping[str, Mapping[str, Any]]) -> None:
        self.results = results

    def endpoint(self, name: str) -> Any:
        raise AssertionError(f"no service should be called, asked for {name}")


async def test_without_the_chat_steps_model_the_step_fails_saying_why() -> None:
    with pytest.raises(RagStepError, match="served_model"):
        await rag(_Ctx({"train": {"checkpoint_uri": "x"}}))
