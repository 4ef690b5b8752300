"""Cross-encoder reranking quality on a BEIR test split, in-process, CPU-bounded.

    python load/retrieval/bench_rerank.py MODEL_DIR [--dataset DIR (default: beir/scifact in FORGE_DATA_DIR)]
        [--first-stage bm25|hybrid] [--depth 20] [--queries 0] [--max-tokens 256] [--int8 | --int8-delta]
        [--retrieval-weight 0.0] [--threads 1] [--work DIR] [--out FILE.json]

Ingests the dataset through ``RetrieverService`` (as ``forge eval retrieval`` does, reusing
``--work``), searches every judged test query (the first ``--queries`` when above 0) with the
first stage, and reranks its first ``--depth`` documents (title + best chunk) with the reranker's
``CrossEncoderScorer`` loaded from ``MODEL_DIR``, blended with the first stage's scores at
``--retrieval-weight`` as the reranker service does (0: the model alone). Prints one JSON line:
nDCG@10 and recall@100 of the first stage and of first stage + rerank over the same queries, and
the reranker's pairs/s; with ``--int8-delta`` the same candidates are reranked by the fp32 model and
by its INT8 quantisation, and the line has both and the accuracy the quantisation costs.
``forge eval retrieval --modes hybrid_rerank`` is the benchmark contract (through a reranker
process); this script is the cheap way to judge a freshly trained model on a small CPU machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Sequence
from pathlib import Path

from forge_kit.paths import resolve_data_path
from forge_reranker.scoring import CrossEncoderScorer
from forge_reranker.service import blend
from forge_retriever import evaluation
from forge_retriever.config import RetrieverSettings
from forge_retriever.embed import embedder_for


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
    embedder = embedder_for(settings) if dense else None
    speed: dict[bool, tuple[int, float]] = {}

    def reranker(int8: bool) -> evaluation.Rerank:
        scorer = CrossEncoderScorer(
            args.model, max_tokens=args.max_tokens, batch_size=16, int8=int8, num_threads=args.threads
        )

        async def rerank(
            query: str, passages: Sequence[tuple[str, str, float]], time_left_s: float | None
        ) -> evaluation.Reranked:
            started = time.perf_counter()
            scores = await asyncio.to_thread(scorer.score, query, [t for _, t, _ in passages])
            pairs, seconds = speed.get(int8, (0, 0.0))
            speed[int8] = (pairs + len(passages), seconds + time.perf_counter() - started)
            final = blend(scores, [s for _, _, s in passages], args.retrieval_weight)
            order = sorted(range(len(passages)), key=lambda i: -final[i])
            return evaluation.Reranked([passages[i][0] for i in order], len(passages))

        return rerank

    variants = [False, True] if args.int8_delta else [args.int8]
    ev = evaluation.Evaluator(data, args.work, embedder, settings)
    await ev.open()
    try:
        await ev.ingest()
        mode = evaluation.SearchMode.HYBRID if dense else evaluation.SearchMode.SPARSE
        first = await ev.run_mode(mode)
        results = {v: await ev.run_mode(mode, rerank=reranker(v), rerank_depth=args.depth) for v in variants}
    finally:
        await ev.close()
    reranked = results[variants[-1]]
    pairs, seconds = speed[variants[-1]]
    extra: dict[str, object] = {}
    if args.int8_delta:
        fp32_pairs, fp32_s = speed[False]
        extra = {
            "fp32_reranked_ndcg@10": round(results[False].ndcg_at_10, 4),
            "int8_reranked_ndcg@10": round(results[True].ndcg_at_10, 4),
            "int8_delta_ndcg@10": round(results[True].ndcg_at_10 - results[False].ndcg_at_10, 4),
            "fp32_pairs_per_s": round(fp32_pairs / fp32_s, 1) if fp32_s else None,
        }
    return {
        "dataset": data.name,
        "queries": len(data.queries),
        "first_stage": args.first_stage,
        "depth": args.depth,
        "max_tokens": args.max_tokens,
        "int8": variants[-1],
        "retrieval_weight": args.retrieval_weight,
        "threads": args.threads,
        "model": str(args.model),
        "first_stage_ndcg@10": round(first.ndcg_at_10, 4),
        "reranked_ndcg@10": round(reranked.ndcg_at_10, 4),
        "recall@100": round(reranked.recall_at_100, 4),
        "rerank_pairs_per_s": round(pairs / seconds, 1) if seconds else None,
        "reranked_p50_ms": round(reranked.p50_ms, 1),
        "reranked_p95_ms": round(reranked.p95_ms, 1),
        **extra,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", type=Path, help="HF cross-encoder directory")
    parser.add_argument("--dataset", type=Path, default=resolve_data_path("beir/scifact"))
    parser.add_argument("--first-stage", choices=("bm25", "hybrid"), default="bm25")
    parser.add_argument("--depth", type=int, default=20)
    parser.add_argument("--queries", type=int, default=0, help="first N judged test queries (0: all)")
    parser.add_argument("--max-tokens", type=int, default=256)
    quantisation = parser.add_mutually_exclusive_group()
    quantisation.add_argument("--int8", action="store_true", help="rerank with the INT8 model")
    quantisation.add_argument(
        "--int8-delta", action="store_true", help="rerank with fp32 and INT8, print both"
    )
    parser.add_argument(
        "--retrieval-weight", type=float, default=0.0, help="the first stage's share of the blended order"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads of the cross-encoder")
    parser.add_argument("--work", type=Path, default=Path("var/eval/work-rerank"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.depth < 1 or args.queries < 0 or args.threads < 1 or not 0 <= args.retrieval_weight <= 1:
        parser.error(
            "--depth and --threads must be at least 1, --queries at least 0, --retrieval-weight in [0, 1]"
        )
    result = asyncio.run(run(args))
    line = json.dumps(result)
    print(line)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(line + "\n")


if __name__ == "__main__":
    main()
