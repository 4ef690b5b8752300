"""Recall@10 against queries/s for one Qdrant Edge shard of dense vectors (HNSW), the figures the
retriever README's 100M-document plan rests on.

    python load/retrieval/bench_hnsw.py --out DIR [--vectors 200000] [--dim 384]
        [--data mixture|gaussian|FILE.npy] [--queries 500] [--m 16] [--ef-construct 100]
        [--ef 16,32,64,128,256] [--quantization none|scalar|binary] [--oversampling 1.0]
        [--threads 0] [--seed 0]

1. **Vectors**: ``FILE.npy`` (any N x D float array, e.g. production embeddings; queries are then
   held-out rows of it), or a synthetic set: ``mixture`` — unit vectors drawn around 2,000 random
   centres (clustered, as sentence embeddings are), ``gaussian`` — isotropic unit vectors (no
   structure: the hardest case for a graph index). Queries come from the same distribution and are
   not in the index.
2. **Truth**: the exact cosine top-10 of every query, by numpy over all vectors.
3. **Build**: one shard (cosine, HNSW ``m``/``ef_construct``, optional scalar int8 or binary
   quantization: candidates by the quantized vectors, ``--oversampling`` × 10 of them rescored
   with the float32 ones), upserted in batches, then ``optimize()`` — Qdrant Edge builds the
   HNSW graph only when its optimizers run. Build seconds and the on-disk size are recorded.
4. **Curve**: for each ``hnsw_ef``, every query once from one client thread: recall@10 against the
   truth, queries/s and latency p50/p99; ``exact`` (full scan) as the reference point.

Writes ``DIR/summary.json`` and prints the table. Queries/s are those of one client
thread; the shard searches its segments on its own thread pool (``--threads``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import qdrant_edge as qe

VECTOR = "dense"
K = 10
BATCH = 2_000
CENTRES = 2_000


def unit(rows: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    out: npt.NDArray[np.float32] = (rows / np.maximum(norms, 1e-12)).astype(np.float32)
    return out


def synthetic(kind: str, n: int, dim: int, rng: np.random.Generator) -> npt.NDArray[np.float32]:
    """``n`` unit vectors: clustered around fixed random centres (``mixture``), or isotropic."""
    if kind == "gaussian":
        return unit(rng.standard_normal((n, dim), dtype=np.float32))
    centres = unit(np.random.default_rng(12345).standard_normal((CENTRES, dim), dtype=np.float32))
    picks = rng.integers(0, CENTRES, n)
    # Spread 0.08 per dimension: cosine to the centre about 0.6 at 384 dims, neighbours within a
    # cluster closer than across, as in sentence-embedding sets.
    return unit(centres[picks] + rng.standard_normal((n, dim), dtype=np.float32) * 0.08)


def load_vectors(
    data: str, n: int, queries: int, dim: int, seed: int
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    rng = np.random.default_rng(seed)
    if data in ("mixture", "gaussian"):
        return synthetic(data, n, dim, rng), synthetic(data, queries, dim, rng)
    rows = np.load(data, mmap_mode="r")
    if rows.ndim != 2 or len(rows) < queries + 1:
        raise SystemExit(f"{data}: need a 2-D array with more than {queries} rows, got shape {rows.shape}")
    order = rng.permutation(len(rows))
    held, kept = order[:queries], order[queries : queries + n]
    return unit(np.asarray(rows[kept], dtype=np.float32)), unit(np.asarray(rows[held], dtype=np.float32))


def exact_top_k(vectors: npt.NDArray[np.float32], queries: npt.NDArray[np.float32]) -> npt.NDArray[np.int64]:
    """Indices of each query's ``K`` nearest vectors by cosine (dot product of unit vectors)."""
    best_scores = np.full((len(queries), K), -np.inf, dtype=np.float32)
    best_ids = np.zeros((len(queries), K), dtype=np.int64)
    for start in range(0, len(vectors), 50_000):
        scores = queries @ vectors[start : start + 50_000].T
        top = np.argpartition(-scores, K - 1, axis=1)[:, :K]
        merged_scores = np.concatenate([best_scores, np.take_along_axis(scores, top, axis=1)], axis=1)
        merged_ids = np.concatenate([best_ids, top + start], axis=1)
        keep = np.argsort(-merged_scores, axis=1)[:, :K]
        best_scores = np.take_along_axis(merged_scores, keep, axis=1)
        best_ids = np.take_along_axis(merged_ids, keep, axis=1)
    return best_ids


def quantization(kind: str) -> qe.ScalarQuantizationConfig | qe.BinaryQuantizationConfig | None:
    if kind == "scalar":
        return qe.ScalarQuantizationConfig(type=qe.ScalarType.Int8, quantile=0.99, always_ram=True)
    if kind == "binary":
        return qe.BinaryQuantizationConfig(always_ram=True)
    return None


def build(
    path: Path, vectors: npt.NDArray[np.float32], args: argparse.Namespace
) -> tuple[qe.EdgeShard, dict[str, float]]:
    config = qe.EdgeConfig(
        vectors={VECTOR: qe.EdgeVectorParams(size=vectors.shape[1], distance=qe.Distance.Cosine)},
        hnsw_config=qe.HnswIndexConfig(m=args.m, ef_construct=args.ef_construct, full_scan_threshold=10),
        quantization_config=quantization(args.quantization),
        optimizers=qe.EdgeOptimizersConfig(indexing_threshold=1_000, default_segment_number=1),
        max_search_threads=args.threads or None,
    )
    shard = qe.EdgeShard.create(str(path), config)
    started = time.perf_counter()
    for at in range(0, len(vectors), BATCH):
        rows = vectors[at : at + BATCH]
        points = [qe.Point(at + i, {VECTOR: row.tolist()}) for i, row in enumerate(rows)]
        shard.update(qe.UpdateOperation.upsert_points(points))
    upserted = time.perf_counter()
    shard.optimize()
    shard.flush()
    optimized = time.perf_counter()
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return shard, {
        "upsert_s": round(upserted - started, 1),
        "optimize_s": round(optimized - upserted, 1),
        "disk_mb": round(size / 2**20, 1),
    }


def sweep(
    shard: qe.EdgeShard,
    queries: npt.NDArray[np.float32],
    truth: npt.NDArray[np.int64],
    params: qe.SearchParams,
) -> dict[str, float]:
    """Every query once: recall@10 against the truth, queries/s, latency p50/p99 (ms)."""
    found, latencies = 0, []
    as_lists = [q.tolist() for q in queries]
    started = time.perf_counter()
    for row, query in enumerate(as_lists):
        t0 = time.perf_counter()
        hits = shard.query(
            qe.QueryRequest(limit=K, query=qe.Query.Nearest(query, using=VECTOR), params=params)
        )
        latencies.append(time.perf_counter() - t0)
        found += len({int(h.id) for h in hits}.intersection(truth[row].tolist()))
    elapsed = time.perf_counter() - started
    latencies.sort()
    return {
        "recall@10": round(found / (K * len(queries)), 4),
        "qps": round(len(queries) / elapsed, 1),
        "p50_ms": round(statistics.median(latencies) * 1000, 2),
        "p99_ms": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1000, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--vectors", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--data", default="mixture", help="mixture, gaussian, or a .npy file of vectors")
    parser.add_argument("--queries", type=int, default=500)
    parser.add_argument("--m", type=int, default=16)
    parser.add_argument("--ef-construct", type=int, default=100)
    parser.add_argument("--ef", default="16,32,64,128,256")
    parser.add_argument("--quantization", choices=("none", "scalar", "binary"), default="none")
    parser.add_argument(
        "--oversampling", type=float, default=1.0, help="quantized: candidates rescored per result wanted"
    )
    parser.add_argument("--threads", type=int, default=0, help="shard search threads (0: one per CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", type=Path, default=None, help="where the shard is built (a temp dir)")
    args = parser.parse_args(argv)
    if args.vectors < 1 or args.queries < 1:
        parser.error("--vectors and --queries must be positive")
    efs = [int(e) for e in args.ef.split(",") if e.strip()]

    vectors, queries = load_vectors(args.data, args.vectors, args.queries, args.dim, args.seed)
    started = time.perf_counter()
    truth = exact_top_k(vectors, queries)
    truth_s = time.perf_counter() - started
    work = Path(tempfile.mkdtemp(prefix="bench-hnsw-", dir=args.work_dir))
    try:
        shard, built = build(work / "shard", vectors, args)
        rescore = (
            qe.QuantizationSearchParams(rescore=True, oversampling=args.oversampling)
            if args.quantization != "none"
            else None
        )
        curve = [
            {"hnsw_ef": ef, **sweep(shard, queries, truth, qe.SearchParams(hnsw_ef=ef, quantization=rescore))}
            for ef in efs
        ]
        exact = sweep(shard, queries, truth, qe.SearchParams(exact=True))
        shard.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    n, dim = vectors.shape
    summary = {
        "vectors": n,
        "dim": dim,
        "data": args.data,
        "queries": len(queries),
        "hnsw": {"m": args.m, "ef_construct": args.ef_construct},
        "quantization": args.quantization,
        "oversampling": args.oversampling if args.quantization != "none" else None,
        "build": built,
        "truth_s": round(truth_s, 1),
        "memory_mb": {
            "float32_vectors": round(n * dim * 4 / 2**20, 1),
            "int8_vectors": round(n * dim / 2**20, 1),
            "binary_vectors": round(n * dim / 8 / 2**20, 1),
            "hnsw_links_level0": round(n * 2 * args.m * 4 / 2**20, 1),
        },
        "curve": curve,
        "exact": exact,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(
        f"{n:,} x {dim} ({args.data}), m={args.m}, ef_construct={args.ef_construct}, quantization={args.quantization}"
    )
    print(
        f"build: upsert {built['upsert_s']} s, optimize (HNSW) {built['optimize_s']} s, {built['disk_mb']} MB on disk"
    )
    print(f"{'hnsw_ef':>8} {'recall@10':>10} {'qps':>8} {'p50 ms':>8} {'p99 ms':>8}")
    rows: list[dict[str, Any]] = [*curve, {"hnsw_ef": "exact", **exact}]
    for row in rows:
        print(
            f"{row['hnsw_ef']!s:>8} {row['recall@10']:>10.4f} {row['qps']:>8.1f} {row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
