"""``forge eval retrieval``: retrieval quality and latency on a BEIR folder (see ``evaluation.py``).

The app is registered as ``forge.cli`` ``eval``; the forge CLI merges it with the eval service's
``forge eval`` commands. ``python -m forge_retriever.cli retrieval …`` runs it directly.

Writes ``OUT/summary.json`` = ``{"<mode>": {"ndcg@10", "recall@100", "p50_ms", "p95_ms"}}`` and
``OUT/details.json`` (ingestion throughput, settings, published figures) and prints a table beside
the published numbers. ``hybrid_rerank`` sends the hybrid candidates to a running reranker over gRPC
(``--reranker-target``): ``--rerank-depth`` documents for the latency-meeting entry and
``--rerank-depth-best`` for ``hybrid_rerank_best``.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import grpc
import typer
from forge.rerank.v1 import rerank_pb2, rerank_pb2_grpc

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
) -> None:
    """nDCG@10, recall@100 and per-query latency p50/p95 for each mode on the test split."""
    try:
        wanted = evaluation.parse_modes(modes)
        data = evaluation.load_beir(dataset, split)
    except ValueError as exc:
        typer.echo(f"forge eval retrieval: {exc}", err=True)
        raise typer.Exit(2) from exc
    token = clitools.resolve_token("reranker", reranker_token) if "hybrid_rerank" in wanted else ""
    summary, details = asyncio.run(
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
        )
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "details.json").write_text(json.dumps(details, indent=2) + "\n")
    _print_table(data.name, summary, details)


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
) -> tuple[dict[str, dict[str, float]], dict[str, object]]:
    needs_dense = any(m != "bm25" for m in modes)
    # No query cache: every mode pays for its own query embedding, as a first-time query would.
    settings = RetrieverSettings(
        data_dir=str(work), kafka_enabled=False, dense_enabled=needs_dense, query_cache_size=0
    )
    embedder = embedder_for(settings) if needs_dense else None
    ev = evaluation.Evaluator(data, work, embedder, settings)
    await ev.open()
    try:
        ingest = await ev.ingest(lambda done, total: typer.echo(f"ingested {done}/{total}", err=True))
        typer.echo(
            f"ingestion: {ingest.upserted} of {ingest.documents} documents new, {ingest.chunks} chunks, "
            f"{ingest.seconds:.1f} s ({ingest.docs_per_s:.1f} new documents/s)",
            err=True,
        )
        summary: dict[str, dict[str, float]] = {}
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
                            evaluation.SearchMode.HYBRID, rerank=rerank, rerank_depth=d, budget_ms=budget
                        )
                        summary[name] = result.as_json()
                        stages[name] = {k: round(v, 2) for k, v in result.stages.items()}
            else:
                result = await ev.run_mode(evaluation.MODES[mode])
                summary[mode] = result.as_json()
                stages[mode] = {k: round(v, 2) for k, v in result.stages.items()}
            typer.echo(f"{mode}: done", err=True)
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


def _print_table(name: str, summary: dict[str, dict[str, float]], details: dict[str, object]) -> None:
    published = evaluation.PUBLISHED.get(name, {})
    typer.echo(f"\n{name}: {details['queries']} test queries, {details['documents']} documents")
    typer.echo(f"{'mode':<20}{'nDCG@10':>9}{'R@100':>8}{'p50 ms':>9}{'p95 ms':>9}   published nDCG@10")
    for mode, row in summary.items():
        pub = published.get(mode.removesuffix("_best"))
        ref = f"{pub[0]:.4f} ({pub[1]})" if pub else "-"
        typer.echo(
            f"{mode:<20}{row['ndcg@10']:>9.4f}{row['recall@100']:>8.4f}{row['p50_ms']:>9.1f}{row['p95_ms']:>9.1f}   {ref}"
        )


if __name__ == "__main__":
    app()
