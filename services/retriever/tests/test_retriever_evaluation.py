"""The retrieval benchmark's pieces: BEIR loading, the metrics, and ``forge eval retrieval`` end to end
on a small BEIR folder written here (BM25 only, so no model is loaded)."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Sequence
from pathlib import Path

import grpc
import pytest
from forge.rerank.v1 import rerank_pb2, rerank_pb2_grpc
from typer.testing import CliRunner

from forge_kit.grpckit import make_channel
from forge_kit.testing.grpcserver import grpc_test_server
from forge_retriever import evaluation
from forge_retriever.cli import app, grpc_rerank
from forge_retriever.config import RetrieverSettings
from forge_retriever.embed import SentenceTransformerEmbedder


def write_beir(folder: Path, qrels: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    corpus = [
        {"_id": "d1", "title": "Aspirin", "text": "Aspirin lowers the risk of heart attack in adults."},
        {"_id": "d2", "title": "Volcanoes", "text": "Volcanic ash travels far in the upper atmosphere."},
        {"_id": "d3", "title": "Bread", "text": "Sourdough bread rises slowly with wild yeast."},
        {"_id": "d4", "title": "Title only", "text": ""},
    ]
    queries = [
        {"_id": "q1", "text": "does aspirin prevent heart attack"},
        {"_id": "q2", "text": "volcanic ash atmosphere"},
        {"_id": "q3", "text": "a query without qrels"},
    ]
    (folder / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in corpus))
    (folder / "queries.jsonl").write_text("".join(json.dumps(r) + "\n" for r in queries))
    (folder / "qrels").mkdir(exist_ok=True)
    (folder / "qrels" / "test.tsv").write_text(
        qrels if qrels is not None else "query-id\tcorpus-id\tscore\nq1\td1\t1\nq2\td2\t2\nq2\td3\t0\n"
    )
    return folder


def test_ndcg_and_recall_match_hand_computed_values() -> None:
    relevant = {"a": 2, "b": 1, "z": 0}
    assert evaluation.ndcg_at_k(["a", "b", "c"], relevant) == pytest.approx(1.0)
    # b at rank 1, a at rank 3: (1/log2(2) + 2/log2(4)) / (2/log2(2) + 1/log2(3))
    expected = (1.0 + 2.0 / 2.0) / (2.0 + 1.0 / math.log2(3))
    assert evaluation.ndcg_at_k(["b", "c", "a"], relevant) == pytest.approx(expected)
    assert evaluation.ndcg_at_k(["c", "a"], relevant, k=1) == 0.0
    assert evaluation.recall_at_k(["c", "a"], relevant, k=100) == 0.5  # "z" (score 0) is not relevant
    assert evaluation.recall_at_k(["c", "a"], relevant, k=1) == 0.0


def test_load_beir_keeps_judged_queries_and_names_bad_lines(tmp_path: Path) -> None:
    data = evaluation.load_beir(write_beir(tmp_path / "ok"))
    assert sorted(data.queries) == ["q1", "q2"] and data.name == "ok"
    assert [d.id for d in data.corpus] == ["d1", "d2", "d3", "d4"] and data.corpus[3].text == "Title only"
    bad = write_beir(tmp_path / "bad", qrels="query-id\tcorpus-id\tscore\nq1\td1\tyes\n")
    with pytest.raises(evaluation.DatasetError, match="line 2"):
        evaluation.load_beir(bad)
    (tmp_path / "bad" / "corpus.jsonl").write_text('{"_id": "x", "text": "fine"}\n{"text": "no id"}\n')
    with pytest.raises(evaluation.DatasetError, match=r"corpus\.jsonl line 2: _id"):
        evaluation.load_beir(bad)
    with pytest.raises(evaluation.DatasetError, match=r"missing corpus\.jsonl"):
        evaluation.load_beir(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="--modes"):
        evaluation.parse_modes("bm25,colbert")
    (tmp_path / "ok" / "qrels" / "dev.tsv").write_text("query-id\tcorpus-id\tscore\nq3\td2\t1\n")
    dev = evaluation.load_beir(tmp_path / "ok", "dev")
    assert dev.split == "dev" and list(dev.queries) == ["q3"] and dev.qrels == {"q3": {"d2": 1}}
    with pytest.raises(evaluation.DatasetError, match=r"missing qrels/train\.tsv"):
        evaluation.load_beir(tmp_path / "ok", "train")


def test_cli_writes_the_contract_summary(tmp_path: Path) -> None:
    dataset = write_beir(tmp_path / "tiny")
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app,
        [
            "retrieval",
            "--dataset",
            str(dataset),
            "--modes",
            "bm25",
            "--out",
            str(out),
            "--work",
            str(tmp_path / "w"),
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary) == ["bm25", "protocol"]
    assert summary["protocol"]["ignore_identical_ids"] is True
    assert (out / "bm25.run").is_file()
    assert set(summary["bm25"]) == {"ndcg@10", "recall@100", "p50_ms", "p95_ms"}
    # Both judged queries find their document first: perfect scores.
    assert summary["bm25"]["ndcg@10"] == 1.0 and summary["bm25"]["recall@100"] == 1.0
    assert 0 < summary["bm25"]["p50_ms"] <= summary["bm25"]["p95_ms"]
    details = json.loads((out / "details.json").read_text())
    assert details["documents"] == 4 and details["queries"] == 2 and details["split"] == "test"
    stage = details["stages"]["bm25"]
    assert 0 < stage["retrieve_p50_ms"] <= stage["retrieve_p95_ms"] and "rerank_p50_ms" not in stage


def test_cli_rejects_a_folder_that_is_not_beir(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["retrieval", "--dataset", str(tmp_path), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "missing corpus.jsonl" in result.output
    assert not (tmp_path / "o").exists()


async def test_ingestion_is_compared_with_plain_sentence_transformers(
    tmp_path: Path, minilm: SentenceTransformerEmbedder
) -> None:
    data = evaluation.load_beir(write_beir(tmp_path / "tiny"))
    settings = RetrieverSettings(data_dir=str(tmp_path), kafka_enabled=False, embedding_backend="torch")
    comparison = await evaluation.compare_ingestion(data, minilm, settings, sample=3)
    figures = comparison.as_json()
    assert figures["documents"] == 3
    assert figures["service_docs_per_s"] > 0 and figures["sentence_transformers_docs_per_s"] > 0
    assert figures["service_over_sentence_transformers"] == pytest.approx(
        # Rounded to 3 decimals: off by at most 5e-4, which is more than 1 % of a small ratio.
        comparison.service_docs_per_s / comparison.sentence_transformers_docs_per_s,
        rel=1e-2,
        abs=5e-4,
    )


async def test_rerank_gets_what_the_search_left_of_the_budget(tmp_path: Path) -> None:
    data = evaluation.load_beir(write_beir(tmp_path / "tiny"))
    settings = RetrieverSettings(data_dir=str(tmp_path), kafka_enabled=False, dense_enabled=False)
    ev = evaluation.Evaluator(data, tmp_path / "w", None, settings)
    seen: list[float | None] = []
    first_stage: list[list[float]] = []

    async def reverse(
        query: str, passages: Sequence[tuple[str, str, float]], time_left_s: float | None
    ) -> evaluation.Reranked:
        ids = [i for i, _, _ in passages]
        seen.append(time_left_s)
        first_stage.append([score for _, _, score in passages])
        return evaluation.Reranked(list(reversed(ids)), len(ids))

    await ev.open()
    try:
        await ev.ingest()
        plain = await ev.run_mode(evaluation.SearchMode.SPARSE)
        budgeted = await ev.run_mode(
            evaluation.SearchMode.SPARSE, rerank=reverse, rerank_depth=2, budget_ms=500
        )
        unbounded = await ev.run_mode(evaluation.SearchMode.SPARSE, rerank=reverse, rerank_depth=2)
    finally:
        await ev.close()
    assert (
        len(seen) == 4 and all(t is not None and 0 < t < 0.5 for t in seen[:2]) and seen[2:] == [None, None]
    )
    # The search's scores travel with the passages, best first, for the reranker to blend.
    assert all(scores and scores == sorted(scores, reverse=True) and scores[0] > 0 for scores in first_stage)
    # Each query matches one document here: reranking it changes nothing, and the figures say so.
    assert budgeted.ndcg_at_10 == plain.ndcg_at_10 == 1.0
    assert budgeted.stages["reranked_mean"] == 1.0 and "rerank_p95_ms" in unbounded.stages
    assert "rerank_p50_ms" not in plain.stages


class SlowReranker(rerank_pb2_grpc.RerankerServiceServicer):
    """Answers in request order after ``delay_s``."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    async def Rerank(
        self, request: rerank_pb2.RerankRequest, context: grpc.aio.ServicerContext
    ) -> rerank_pb2.RerankResponse:
        await asyncio.sleep(self.delay_s)
        results = [rerank_pb2.RankedPassage(id=p.id, index=i) for i, p in enumerate(request.passages)]
        return rerank_pb2.RerankResponse(results=results[::-1], scored=len(results))


@pytest.mark.integration
async def test_a_rerank_past_its_deadline_keeps_the_retriever_order_and_is_counted() -> None:
    async with (
        grpc_test_server(
            rerank_pb2_grpc.add_RerankerServiceServicer_to_server,
            SlowReranker(0.3),
            "forge.rerank.v1.RerankerService",
            token="t",
        ) as server,
        make_channel(f"127.0.0.1:{server.port}", token="t") as channel,
    ):
        rerank = grpc_rerank(rerank_pb2_grpc.RerankerServiceStub(channel))  # type: ignore[arg-type]
        passages = [("a", "text a", 2.0), ("b", "text b", 1.0)]
        assert await rerank("q", passages, 0.05) == evaluation.Reranked(["a", "b"], 0, overran=True)
        assert await rerank("q", passages, None) == evaluation.Reranked(["b", "a"], 2)
