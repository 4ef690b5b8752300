"""``forge eval retrieval``: retrieval quality and latency on a BEIR folder (see ``evaluation.py``).

The app is registered as ``forge.cli`` ``eval``; the forge CLI merges it with the eval service's
``forge eval`` commands. ``python -m forge_retriever.cli retrieval …`` runs it directly.

Writes ``OUT/summary.json`` = ``{"<mode>": {"ndcg@10", "recall@100", "p50_ms", "p95_ms"}, …,
"protocol": {…}}`` (``protocol``: whether hits with the query's own id were dropped, as BEIR's
``ignore_identical_ids`` does by default, ``--keep-identical-ids`` to keep them; per mode the queries
that failed and those whose embedding was cut; the run files), ``OUT/<mode>.run`` (each mode's
ranking as a TREC run file: ``qid Q0 docid rank score run_name``, which pytrec_eval or ir_measures
re-score to the same figures) and ``OUT/details.json`` (ingestion throughput, settings, published
figures), and prints a table beside the published numbers. Progress (ingestion, then each mode's
queries) is drawn on stderr when it is a terminal and not ``--quiet``. ``hybrid_rerank`` sends the hybrid candidates to a running reranker over gRPC
(``--reranker-target``): ``--rerank-depth`` documents for the latency-meeting entry and
``--rerank-depth-best`` for ``hybrid_rerank_best``.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated

import grpc
import typer
from forge.rerank.v1 import rerank_pb2, rerank_pb2_grpc
from rich.progress import Progress

from forge_kit import clitools
from forge_kit.grpckit import make_channel
from forge_retriever import evaluation
from forge_retriever.config import RetrieverSettings
from forge_retriever.embed import embedder_for

app = typer.Typer(help="Evaluation suites served by the retriever.", no_args_is_help=True)


@app.callback()
def _group() -> None:
    """Evaluation suites (``retrieval``)."""


@app.command()
def retrieval(
    dataset: Annotated[
        Path, typer.Option("--dataset", help="BEIR folder: corpus.jsonl, queries.jsonl, qrels/test.tsv.")
    ],
    out: Annotated[Path, typer.Option("--out", help="Folder for summary.json and details.json.")],
    modes: Annotated[
        str, typer.Option("--modes", help="Comma-separated: bm25, dense, hybrid, hybrid_rerank.")
    ] = ("bm25,dense,hybrid"),
    work: Annotated[
        Path | None,
        typer.Option("--work", help="Keep the database and index here (reuse skips re-embedding)."),
    ] = None,
    reranker_target: Annotated[
        str,
        typer.Option(
            "--reranker-target", envvar="FORGE_CLI_RERANKER_TARGET", help="Reranker gRPC host:port."
        ),
    ] = "127.0.0.1:50056",
    reranker_token: Annotated[
        str, clitools.token_option("FORGE_CLI_RERANKER_TOKEN", "reranker token", "--reranker-token-file")
    ] = "",
    rerank_depth: Annotated[
        int,
        typer.Option("--rerank-depth", min=1, help="Documents sent to the reranker (latency config)."),
    ] = 20,
    latency_budget_ms: Annotated[
        float,
        typer.Option(
            "--latency-budget-ms",
            min=1.0,
            help="Retrieval + rerank budget per query (latency config): the reranker's deadline is what search left.",
        ),
    ] = 200.0,
    rerank_depth_best: Annotated[
        int, typer.Option("--rerank-depth-best", min=1, help="Documents reranked (unconstrained).")
    ] = 100,
    split: Annotated[
        str, typer.Option("--split", help="Which qrels/<split>.tsv judges the queries (test, dev, train).")
    ] = "test",
    ingest_sample: Annotated[
        int,
        typer.Option(
            "--ingest-sample",
            min=0,
            help="Documents ingested afresh and embedded by plain sentence-transformers, to compare (0: skip).",
        ),
    ] = 256,
    ignore_identical_ids: Annotated[
        bool,
        typer.Option(
            "--ignore-identical-ids/--keep-identical-ids",
            help="Drop a hit whose id is the query's own before scoring (BEIR's default).",
        ),
    ] = True,
    quiet: Annotated[bool, clitools.QuietOption] = False,
) -> None:
    """nDCG@10, recall@100 and per-query latency p50/p95 for each mode on the test split."""
    try:
        wanted = evaluation.parse_modes(modes)
        data = evaluation.load_beir(dataset, split)
    except ValueError as exc:
        typer.echo(f"forge eval retrieval: {exc}", err=True)
        raise typer.Exit(2) from exc
    token = clitools.resolve_token("reranker", reranker_token) if "hybrid_rerank" in wanted else ""
    out.mkdir(parents=True, exist_ok=True)
    with clitools.progress(quiet) as bar:
        results, details = asyncio.run(
            _run(
                data,
                wanted,
                work or evaluation.default_work_dir(),
                reranker_target,
                token,
                rerank_depth,
                rerank_depth_best,
                latency_budget_ms,
                ingest_sample,
                ignore_identical_ids,
                bar,
            )
        )
    summary: dict[str, object] = {mode: result.as_json() for mode, result in results.items()}
    for mode, result in results.items():
        evaluation.write_trec_run(out / f"{mode}.run", result.ranking, f"forge-{mode}")
    summary["protocol"] = {
        "ignore_identical_ids": ignore_identical_ids,
        "split": data.split,
        "queries": len(data.queries),
        "failed_queries_score": 0.0,
        "run_files": {mode: f"{mode}.run" for mode in results},
        "modes": {mode: result.counts() for mode, result in results.items()},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "details.json").write_text(json.dumps(details, indent=2) + "\n")
    _print_table(data.name, results, details, ignore_identical_ids)
    dead = [mode for mode, result in results.items() if result.failed == len(data.queries)]
    if dead:
        first = results[dead[0]].errors[0] if results[dead[0]].errors else ""
        typer.echo(f"forge eval retrieval: every query of {', '.join(dead)} failed; first: {first}", err=True)
        raise typer.Exit(1)
    # A rerank mode where no query was reranked measured the retriever, not the reranker.
    unranked = [
        mode
        for mode, result in results.items()
        if result.rerank_fallbacks and result.rerank_fallbacks + result.failed == len(data.queries)
    ]
    if unranked:
        first = results[unranked[0]].errors[-1] if results[unranked[0]].errors else ""
        typer.echo(
            f"forge eval retrieval: every query of {', '.join(unranked)} fell back to the retrieval order"
            f" (the reranker refused or failed); last: {first}",
            err=True,
        )
        raise typer.Exit(1)


async def _run(
    data: evaluation.BeirDataset,
    modes: Sequence[str],
    work: Path,
    reranker_target: str,
    reranker_token: str,
    depth: int,
    depth_best: int,
    budget_ms: float,
    ingest_sample: int,
    ignore_identical_ids: bool = True,
    bar: Progress | None = None,
) -> tuple[dict[str, evaluation.ModeResult], dict[str, object]]:
    needs_dense = any(m != "bm25" for m in modes)
    # No query cache: every mode pays for its own query embedding, as a first-time query would.
    settings = RetrieverSettings(
        data_dir=str(work), kafka_enabled=False, dense_enabled=needs_dense, query_cache_size=0
    )
    embedder = embedder_for(settings) if needs_dense else None
    ev = evaluation.Evaluator(data, work, embedder, settings)
    await ev.open()
    try:
        ingest = await ev.ingest(_advance(bar, "ingesting the corpus"))
        typer.echo(
            f"ingestion: {ingest.upserted} of {ingest.documents} documents new, {ingest.chunks} chunks, "
            f"{ingest.seconds:.1f} s ({ingest.docs_per_s:.1f} new documents/s)",
            err=True,
        )
        summary: dict[str, evaluation.ModeResult] = {}
        stages: dict[str, dict[str, float]] = {}
        for mode in modes:
            if mode == "hybrid_rerank":
                async with make_channel(reranker_target, token=reranker_token) as channel:
                    stub: rerank_pb2_grpc.RerankerServiceAsyncStub = rerank_pb2_grpc.RerankerServiceStub(
                        channel
                    )  # type: ignore[assignment]
                    rerank = grpc_rerank(stub)
                    configs = (("hybrid_rerank", depth, budget_ms), ("hybrid_rerank_best", depth_best, None))
                    for name, d, budget in configs:
                        result = await ev.run_mode(
                            evaluation.SearchMode.HYBRID,
                            rerank=rerank,
                            rerank_depth=d,
                            budget_ms=budget,
                            ignore_identical_ids=ignore_identical_ids,
                            progress=_advance(bar, f"{name} queries"),
                        )
                        summary[name] = result
                        stages[name] = {k: round(v, 2) for k, v in result.stages.items()}
            else:
                result = await ev.run_mode(
                    evaluation.MODES[mode],
                    ignore_identical_ids=ignore_identical_ids,
                    progress=_advance(bar, f"{mode} queries"),
                )
                summary[mode] = result
                stages[mode] = {k: round(v, 2) for k, v in result.stages.items()}
            for name in ("hybrid_rerank", "hybrid_rerank_best") if mode == "hybrid_rerank" else (mode,):
                failed = summary[name]
                if failed.failed:
                    typer.echo(
                        f"{name}: {failed.failed} of {len(data.queries)} queries failed (scored 0); "
                        f"first: {failed.errors[0]}",
                        err=True,
                    )
                if failed.rerank_fallbacks:
                    typer.echo(
                        f"{name}: {failed.rerank_fallbacks} of {len(data.queries)} queries kept the retrieval"
                        " order (the reranker refused, failed or timed out)",
                        err=True,
                    )
    finally:
        await ev.close()
    comparison = None
    if ingest_sample and embedder is not None:
        comparison = await evaluation.compare_ingestion(data, embedder, settings, ingest_sample)
        typer.echo(
            f"ingestion of {comparison.documents} documents afresh: service {comparison.service_docs_per_s:.1f}/s, "
            f"plain sentence-transformers encode {comparison.sentence_transformers_docs_per_s:.1f}/s",
            err=True,
        )
    details: dict[str, object] = {
        "dataset": data.name,
        "documents": ingest.documents,
        "queries": len(data.queries),
        "split": data.split,
        "ingestion_docs_per_s": round(ingest.docs_per_s, 2),
        "ingestion_new_documents": ingest.upserted,
        "ingestion_new_chunks": ingest.chunks,
        "ingestion_against_sentence_transformers": comparison.as_json() if comparison else None,
        "rerank_depth": depth,
        "latency_budget_ms": budget_ms,
        "stages": stages,
        "rerank_depth_best": depth_best,
        "cpu_threads": os.cpu_count(),
        "settings": settings.model_dump(
            include={
                "chunk_tokens",
                "chunk_overlap_tokens",
                "embedding_max_tokens",
                "embedding_backend",
                "hybrid_candidates",
                "hybrid_fusion",
                "rrf_k",
                "bm25_k1",
                "bm25_b",
                "bm25_avg_len",
            }
        ),
        "published_ndcg@10": {m: v[0] for m, v in evaluation.PUBLISHED.get(data.name, {}).items()},
    }
    return summary, details


def grpc_rerank(stub: rerank_pb2_grpc.RerankerServiceAsyncStub) -> evaluation.Rerank:
    async def rerank(
        query: str, passages: Sequence[tuple[str, str, float]], time_left_s: float | None
    ) -> evaluation.Reranked:
        request = rerank_pb2.RerankRequest(
            query=query,
            passages=[rerank_pb2.Passage(id=i, text=t, retrieval_score=s) for i, t, s in passages],
        )
        if time_left_s is not None and time_left_s <= 0:
            return evaluation.Reranked([i for i, _, _ in passages], 0)  # nothing left: the retriever's order
        try:
            response = await stub.Rerank(request, timeout=60.0 if time_left_s is None else time_left_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is not grpc.StatusCode.DEADLINE_EXCEEDED or time_left_s is None:
                raise
            return evaluation.Reranked([i for i, _, _ in passages], 0, overran=True)
        return evaluation.Reranked([r.id for r in response.results], int(response.scored))

    return rerank


def _advance(bar: Progress | None, description: str) -> Callable[[int, int], None]:
    """A ``progress(done, total)`` callback drawing one task of ``bar``."""
    if bar is None:
        return lambda done, total: None
    task = bar.add_task(description, total=None)

    def update(done: int, total: int) -> None:
        bar.update(task, completed=done, total=total)

    return update


def _print_table(
    name: str,
    results: dict[str, evaluation.ModeResult],
    details: dict[str, object],
    ignore_identical_ids: bool,
) -> None:
    published = evaluation.PUBLISHED.get(name, {})
    typer.echo(f"\n{name}: {details['queries']} test queries, {details['documents']} documents")
    typer.echo(
        "hits with the query's own id: "
        + ("dropped before scoring (BEIR's ignore_identical_ids)" if ignore_identical_ids else "kept")
    )
    typer.echo(f"{'mode':<20}{'nDCG@10':>9}{'R@100':>8}{'p50 ms':>9}{'p95 ms':>9}   published nDCG@10")
    for mode, result in results.items():
        row = result.as_json()
        pub = published.get(mode.removesuffix("_best"))
        ref = f"{pub[0]:.4f} ({pub[1]})" if pub else "-"
        typer.echo(
            f"{mode:<20}{row['ndcg@10']:>9.4f}{row['recall@100']:>8.4f}{row['p50_ms']:>9.1f}{row['p95_ms']:>9.1f}   {ref}"
        )


if __name__ == "__main__":
    app()
