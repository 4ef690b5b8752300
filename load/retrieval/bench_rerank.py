"""Cross-encoder reranking quality on a BEIR test split, in-process, CPU-bounded.

    python load/retrieval/bench_rerank.py MODEL_DIR [--dataset ../shared/data/beir/scifact]
        [--first-stage bm25|hybrid] [--depth 20] [--queries 0] [--max-tokens 256] [--int8]
        [--threads 1] [--work DIR] [--out FILE.json]

Ingests the dataset through ``RetrieverService`` (as ``forge eval retrieval`` does, reusing
``--work``), searches every judged test query (the first ``--queries`` when above 0) with the
first stage, and reranks its first ``--depth`` documents (title + best chunk) with the reranker's
``CrossEncoderScorer`` loaded from ``MODEL_DIR``. Prints one JSON line: nDCG@10 and recall@100 of
the first stage and of first stage + rerank over the same queries, and the reranker's pairs/s.
``forge eval retrieval --modes hybrid_rerank`` is the benchmark contract (through a reranker
process); this script is the cheap way to judge a freshly trained model on a shared 2-core machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from forge_reranker.scoring import CrossEncoderScorer
from forge_retriever import evaluation
from forge_retriever.config import RetrieverSettings
from forge_retriever.embed import SentenceTransformerEmbedder


async def run(args: argparse.Namespace) -> dict[str, object]:
    data = evaluation.load_beir(args.dataset)
    if args.queries:
        keep = list(data.queries)[: args.queries]
        data = evaluation.BeirDataset(
            data.name, data.corpus, {q: data.queries[q] for q in keep}, {q: data.qrels[q] for q in keep}
        )
    dense = args.first_stage == "hybrid"
    settings = RetrieverSettings(
        data_dir=str(args.work),
        kafka_enabled=False,
        dense_enabled=dense,
        query_cache_size=0,
        embedding_threads=1,
    )
    embedder = SentenceTransformerEmbedder(num_threads=1, query_cache_size=0) if dense else None
    scorer = CrossEncoderScorer(
        args.model, max_tokens=args.max_tokens, batch_size=16, int8=args.int8, num_threads=args.threads
    )
    pairs, scoring_s = 0, 0.0

    async def rerank(
        query: str, passages: list[tuple[str, str]], time_left_s: float | None
    ) -> evaluation.Reranked:
        nonlocal pairs, scoring_s
        started = time.perf_counter()
        scores = await asyncio.to_thread(scorer.score, query, [t for _, t in passages])
        scoring_s += time.perf_counter() - started
        pairs += len(passages)
        order = sorted(range(len(passages)), key=lambda i: -scores[i])
        return evaluation.Reranked([passages[i][0] for i in order], len(passages))

    ev = evaluation.Evaluator(data, args.work, embedder, settings)
    await ev.open()
    try:
        await ev.ingest()
        mode = evaluation.SearchMode.HYBRID if dense else evaluation.SearchMode.SPARSE
        first = await ev.run_mode(mode)
        reranked = await ev.run_mode(mode, rerank=rerank, rerank_depth=args.depth)  # type: ignore[arg-type]
    finally:
        await ev.close()
    return {
        "dataset": data.name,
        "queries": len(data.queries),
        "first_stage": args.first_stage,
        "depth": args.depth,
        "max_tokens": args.max_tokens,
        "int8": args.int8,
        "threads": args.threads,
        "model": str(args.model),
        "first_stage_ndcg@10": round(first.ndcg_at_10, 4),
        "reranked_ndcg@10": round(reranked.ndcg_at_10, 4),
        "recall@100": round(reranked.recall_at_100, 4),
        "rerank_pairs_per_s": round(pairs / scoring_s, 1) if scoring_s else None,
        "reranked_p50_ms": round(reranked.p50_ms, 1),
        "reranked_p95_ms": round(reranked.p95_ms, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", type=Path, help="HF cross-encoder directory")
    parser.add_argument("--dataset", type=Path, default=Path("../shared/data/beir/scifact"))
    parser.add_argument("--first-stage", choices=("bm25", "hybrid"), default="bm25")
    parser.add_argument("--depth", type=int, default=20)
    parser.add_argument("--queries", type=int, default=0, help="first N judged test queries (0: all)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--int8", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads of the cross-encoder")
    parser.add_argument("--work", type=Path, default=Path("var/eval/work-rerank"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.depth < 1 or args.queries < 0 or args.threads < 1:
        parser.error("--depth and --threads must be at least 1 and --queries at least 0")
    result = asyncio.run(run(args))
    line = json.dumps(result)
    print(line)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(line + "\n")


if __name__ == "__main__":
    main()
