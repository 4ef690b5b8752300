"""Whole documents as queries, and BEIR's protocol in ``forge eval retrieval``: a 5,500-character
query is answered (BM25 on all of it, the embedding on its head, the cut counted) and evaluated;
a query's own id is dropped from its hits; a failing query is counted, not fatal; the TREC run
files re-score, with ``ir_measures`` (pytrec_eval), to the figures in ``summary.json``."""

from __future__ import annotations

import json
from pathlib import Path

import ir_measures
import pytest
from ir_measures import R, nDCG
from typer.testing import CliRunner

from forge_kit import errors
from forge_retriever import evaluation
from forge_retriever.cli import app
from forge_retriever.config import RetrieverSettings
from forge_retriever.documents import DocumentIn, SearchMode
from forge_retriever.service import RetrieverService

FILLER = "Sediment cores record the climate of past glacial periods in fine layers. "


def long_query(tail: str) -> str:
    """About 5,500 characters: a document of filler whose one distinctive phrase is at the end."""
    body = FILLER * (5_450 // len(FILLER))
    return f"{body}{tail}"


DOCS = [
    DocumentIn(id="d1", title="Aspirin", text="Aspirin lowers the risk of heart attack in adults."),
    DocumentIn(id="d2", title="Tardigrades", text="Tardigrades survive desiccation by vitrification."),
    DocumentIn(id="d3", title="Bread", text="Sourdough bread rises slowly with wild yeast."),
]


async def test_a_5500_character_query_is_answered_in_every_mode(dense_service: RetrieverService) -> None:
    await dense_service.upsert_documents("c", DOCS)
    query = long_query("How do tardigrades survive desiccation?")
    assert 5_400 <= len(query) <= 5_600
    for mode in (SearchMode.SPARSE, SearchMode.DENSE, SearchMode.HYBRID):
        result = await dense_service.search("c", query, 3, mode, {})
        assert result.hits, mode
        assert result.dense_truncated is (mode is not SearchMode.SPARSE)
    # BM25 reads the whole query: the phrase at its very end finds the document.
    sparse = await dense_service.search("c", query, 1, SearchMode.SPARSE, {})
    assert sparse.hits[0].document_id == "d2"
    short = await dense_service.search("c", "tardigrades", 1, SearchMode.HYBRID, {})
    assert not short.dense_truncated


async def test_a_query_past_the_documented_limit_is_refused_naming_it(
    db: object, index: object, settings: RetrieverSettings
) -> None:
    assert settings.max_query_chars == 65_536
    small = settings.model_copy(update={"max_query_chars": 6_000})
    service = RetrieverService(db, index, small)  # type: ignore[arg-type]
    await service.upsert_documents("c", DOCS)
    assert (await service.search("c", long_query("tardigrades"), 3, SearchMode.SPARSE, {})).hits
    with pytest.raises(errors.ValidationError, match="at most 6000 characters"):
        await service.search("c", "x" * 6_001, 3, SearchMode.SPARSE, {})


def write_beir(folder: Path) -> Path:
    """q-d3 is also a corpus document (as in some BEIR sets): its own hit must not count. q-long is
    a whole document; q-huge is past the retriever's limit and fails."""
    folder.mkdir(parents=True, exist_ok=True)
    corpus = [{"_id": d.id, "title": d.title, "text": d.text} for d in DOCS]
    corpus.append({"_id": "q-d3", "title": "Sourdough", "text": "Wild yeast makes sourdough bread rise."})
    corpus.append({"_id": "d4", "title": "Rye", "text": "Rye sourdough bread uses a wild yeast starter."})
    queries = [
        {"_id": "q1", "text": "does aspirin prevent heart attack"},
        {"_id": "q-long", "text": long_query("tardigrades desiccation vitrification")},
        {"_id": "q-d3", "text": "Wild yeast makes sourdough bread rise."},
        {"_id": "q-huge", "text": "bread " * 12_000},
    ]
    (folder / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in corpus))
    (folder / "queries.jsonl").write_text("".join(json.dumps(r) + "\n" for r in queries))
    (folder / "qrels").mkdir(exist_ok=True)
    (folder / "qrels" / "test.tsv").write_text(
        "query-id\tcorpus-id\tscore\nq1\td1\t1\nq-long\td2\t1\nq-d3\td3\t1\nq-d3\td4\t1\nq-huge\td3\t1\n"
    )
    return folder


def _run(tmp_path: Path, *extra: str) -> tuple[dict[str, object], Path]:
    out = tmp_path / ("out" + "".join(extra).replace("-", ""))
    args = ["retrieval", "--dataset", str(write_beir(tmp_path / "set")), "--modes", "bm25", "--out", str(out)]
    args += ["--work", str(tmp_path / "w"), "--quiet", *extra]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    return json.loads((out / "summary.json").read_text()), out


def test_the_evaluation_counts_failures_drops_identical_ids_and_rescores_from_run_files(
    tmp_path: Path,
) -> None:
    summary, out = _run(tmp_path)
    protocol = summary["protocol"]
    assert isinstance(protocol, dict)
    assert protocol["ignore_identical_ids"] is True and protocol["run_files"] == {"bm25": "bm25.run"}
    counts = protocol["modes"]["bm25"]
    # q-huge (72,000 characters) is past the 65,536 limit: counted, reported, scored 0; the rest ran.
    assert counts["failed_queries"] == 1 and counts["errors"][0].startswith("q-huge: ValidationError")
    assert counts["identical_ids_dropped"] == 1
    run = list(ir_measures.read_trec_run(str(out / "bm25.run")))
    assert {r.query_id for r in run} == {"q1", "q-long", "q-d3"}
    assert not [r for r in run if r.query_id == r.doc_id]
    # BEIR's qrels are a TSV with a header, not TREC's four columns: read them as BEIR does.
    rows = (tmp_path / "set" / "qrels" / "test.tsv").read_text().splitlines()[1:]
    qrels = [ir_measures.Qrel(q, d, int(s)) for q, d, s in (row.split("\t") for row in rows)]
    figures = ir_measures.calc_aggregate([nDCG @ 10, R @ 100], qrels, run)
    # ir_measures scores a judged query missing from the run as 0, as the summary scores a failed one.
    assert summary["bm25"]["ndcg@10"] == pytest.approx(figures[nDCG @ 10], abs=1e-4)
    assert summary["bm25"]["recall@100"] == pytest.approx(figures[R @ 100], abs=1e-4)
    per_query = {m.query_id: m.value for m in ir_measures.iter_calc([nDCG @ 10], qrels, run)}
    assert per_query["q-long"] == 1.0  # the whole-document query found its one relevant document first
    assert per_query["q-huge"] == 0.0 and len(per_query) == 4


def test_identical_ids_can_be_kept(tmp_path: Path) -> None:
    dropped, _ = _run(tmp_path)
    kept, out = _run(tmp_path, "--keep-identical-ids")
    assert kept["protocol"]["ignore_identical_ids"] is False  # type: ignore[index]
    assert kept["protocol"]["modes"]["bm25"]["identical_ids_dropped"] == 0  # type: ignore[index]
    run = list(ir_measures.read_trec_run(str(out / "bm25.run")))
    assert [r for r in run if r.query_id == r.doc_id == "q-d3"]
    # The query's own document ranks first and is not relevant: the kept figure is lower.
    assert kept["bm25"]["ndcg@10"] < dropped["bm25"]["ndcg@10"]  # type: ignore[index]


def test_run_file_scores_reproduce_the_ranking(tmp_path: Path) -> None:
    path = tmp_path / "x.run"
    evaluation.write_trec_run(path, {"q": ["b", "a", "c"]}, "forge-x")
    lines = path.read_text().splitlines()
    assert lines == ["q Q0 b 1 3 forge-x", "q Q0 a 2 2 forge-x", "q Q0 c 3 1 forge-x"]


def test_a_mode_whose_every_query_fails_exits_non_zero_after_writing_the_summary(tmp_path: Path) -> None:
    """The reranker is not up: each rerank falls back to the retriever's order and is counted (a
    budgeted one runs out of its budget), as the gateway does; a mode where no query was reranked
    exits non-zero after writing the summary, and the command says so."""
    from forge_kit.testing.processes import free_port

    out = tmp_path / "out"
    args = ["retrieval", "--dataset", str(write_beir(tmp_path / "set")), "--modes", "hybrid_rerank"]
    args += ["--out", str(out), "--work", str(tmp_path / "w"), "--quiet", "--ingest-sample", "0"]
    args += ["--reranker-target", f"127.0.0.1:{free_port()}"]
    result = CliRunner().invoke(app, args, env={"FORGE_CLI_RERANKER_TOKEN": "t"})
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "every query of hybrid_rerank_best fell back to the retrieval order" in result.output
    assert "UNAVAILABLE" in result.output
    summary = json.loads((out / "summary.json").read_text())
    modes = summary["protocol"]["modes"]
    # q-huge is past the retriever's limit (a failed search, 0); the other three keep its order.
    assert modes["hybrid_rerank_best"]["failed_queries"] == 1
    assert modes["hybrid_rerank_best"]["rerank_fallbacks"] == 3
    assert summary["hybrid_rerank_best"]["ndcg@10"] > 0
    assert modes["hybrid_rerank"]["failed_queries"] == 1  # only q-huge, past the query limit
    assert all("\n" not in e for e in modes["hybrid_rerank_best"]["errors"])
