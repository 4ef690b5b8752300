"""Retrieval evaluation on BEIR-format folders: nDCG@10, recall@100 and search latency per mode.

A BEIR folder has ``corpus.jsonl`` (``_id``, ``title``, ``text``), ``queries.jsonl`` (``_id``,
``text``) and ``qrels/test.tsv`` (``query-id``, ``corpus-id``, ``score`` with a header row). The
corpus is ingested through ``RetrieverService`` exactly as UpsertDocuments would (chunking, BM25,
embeddings, the Qdrant Edge index), and every test query is searched through ``RetrieverService.search``,
so the figures are the service's, latency included (query encoding, index, database read).

Metrics are BEIR's (pytrec_eval): nDCG@10 with linear gains ``rel / log2(rank + 1)`` against the
ideal ordering of the query's qrels, recall@100 over the qrels with a score above 0. Chunks are
mapped to documents by their first (best) occurrence. Queries with no relevant document are skipped.

BEIR's protocol, where the figures are compared with published ones:

- ``ignore_identical_ids`` (on by default, as in BEIR's ``EvaluateRetrieval``): a hit whose document
  id equals the query's own id is dropped before scoring (some BEIR sets put the query document in
  the corpus); the number dropped is reported.
- Each mode's ranking is written as a TREC run file (``qid Q0 docid rank score run_name``): the
  score column is ``N - rank + 1``, so a tool that orders by score (pytrec_eval, ir_measures)
  reads back exactly the ranking scored here (RRF ties many fused scores).
- A query that fails (a search error) never stops the evaluation: it is scored as an empty
  ranking, counted, and its first errors reported. A rerank that is refused (a query past the
  reranker's limit), fails or times out keeps the retriever's order for that query, as the
  gateway's RAG path does, and is counted as a rerank fallback.
"""

from __future__ import annotations

import asyncio
import csv
import json
import math
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from forge_kit.db import Database
from forge_kit.stats import percentile
from forge_retriever.config import RetrieverSettings
from forge_retriever.documents import DocumentIn, SearchHit, SearchMode
from forge_retriever.embed import Embedder
from forge_retriever.index import QdrantEdgeIndex
from forge_retriever.indexing import sparse_encoder
from forge_retriever.service import RetrieverService

MODES = {"bm25": SearchMode.SPARSE, "dense": SearchMode.DENSE, "hybrid": SearchMode.HYBRID}
RERANK_MODES = ("hybrid_rerank", "hybrid_rerank_best")
MIGRATIONS = Path(__file__).parent / "migrations"
COLLECTION = "beir"
_INGEST_BATCH = 256
_ERRORS_KEPT = 5

#: Published nDCG@10 on the test splits, as the BEIR and MTEB papers report them, by folder name.
PUBLISHED: dict[str, dict[str, tuple[float, str]]] = {
    "scifact": {
        "bm25": (0.665, "BM25, BEIR paper"),
        "dense": (0.6451, "all-MiniLM-L6-v2, MTEB"),
        "hybrid": (0.7175, "dense + BM25 RRF, Qdrant article"),
        "hybrid_rerank": (0.688, "BM25 top-100 + ms-marco-MiniLM-L-6-v2, BEIR paper"),
    },
    "nfcorpus": {
        "bm25": (0.325, "BM25, BEIR paper"),
        "dense": (0.3159, "all-MiniLM-L6-v2, MTEB"),
        "hybrid": (0.280, "BM25 + all-MiniLM-L6-v2 alpha 0.5, Weaviate"),
        "hybrid_rerank": (0.350, "BM25 top-100 + ms-marco-MiniLM-L-6-v2, BEIR paper"),
    },
}


@dataclass(frozen=True)
class Reranked:
    """A reranker's answer: passage ids best first, and how many of them it scored (a reranker
    with a deadline may score the first few and keep the rest in the order sent)."""

    ids: list[str]
    scored: int
    overran: bool = False
    """The call ran past its deadline: no answer, the retriever's order kept (as the gateway does)."""


#: Reranks ``passages`` (id, text, first-stage score) for ``query`` within ``time_left_s`` (None:
#: no deadline).
Rerank = Callable[[str, Sequence[tuple[str, str, float]], float | None], Awaitable[Reranked]]


class DatasetError(ValueError):
    """The folder is not in BEIR format; the message names the file and line."""


@dataclass(frozen=True)
class BeirDataset:
    """A BEIR folder's corpus, its test queries that have qrels, and those qrels."""

    name: str
    corpus: list[DocumentIn]
    queries: dict[str, str]
    qrels: dict[str, dict[str, int]]
    split: str = "test"


def load_beir(folder: Path, split: str = "test") -> BeirDataset:
    """Read a BEIR folder, checking every row names its fields."""
    paths = {n: folder / n for n in ("corpus.jsonl", "queries.jsonl", f"qrels/{split}.tsv")}
    for name, path in paths.items():
        if not path.is_file():
            raise DatasetError(f"{folder}: missing {name}")
    corpus: list[DocumentIn] = []
    for n, row in _jsonl(paths["corpus.jsonl"]):
        doc_id, text = str(row.get("_id", "")), str(row.get("text", "") or "")
        if not doc_id or any(c.isspace() for c in doc_id):
            raise DatasetError(f"corpus.jsonl line {n}: _id missing, empty or with whitespace")
        title = str(row.get("title", "") or "")
        if not text.strip():
            text = title  # BEIR keeps a few title-only documents: index the title as the text
        if text.strip():
            corpus.append(DocumentIn(id=doc_id, title=title, text=text))
    queries: dict[str, str] = {}
    for n, row in _jsonl(paths["queries.jsonl"]):
        if not row.get("_id") or not str(row.get("text", "")).strip():
            raise DatasetError(f"queries.jsonl line {n}: _id and text must be non-empty")
        if any(c.isspace() for c in str(row["_id"])):
            raise DatasetError(f"queries.jsonl line {n}: _id must not hold whitespace (a TREC run names it)")
        queries[str(row["_id"])] = str(row["text"])
    qrels: dict[str, dict[str, int]] = {}
    with open(paths[f"qrels/{split}.tsv"], encoding="utf-8") as f:
        reader = csv.DictReader(f, delimiter="\t")
        for n, qrel in enumerate(reader, start=2):
            try:
                qrels.setdefault(qrel["query-id"], {})[qrel["corpus-id"]] = int(qrel["score"])
            except (KeyError, TypeError, ValueError) as exc:
                raise DatasetError(
                    f"qrels/{split}.tsv line {n}: need query-id, corpus-id and an integer score"
                ) from exc
    qrels = {q: r for q, r in qrels.items() if q in queries and any(s > 0 for s in r.values())}
    if not qrels:
        raise DatasetError(
            f"qrels/{split}.tsv: no query with a relevant document and a text in queries.jsonl"
        )
    return BeirDataset(folder.name, corpus, {q: queries[q] for q in qrels}, qrels, split)


def _jsonl(path: Path) -> list[tuple[int, dict[str, object]]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path.name} line {n}: not JSON ({exc.msg})") from exc
            if not isinstance(row, dict):
                raise DatasetError(f"{path.name} line {n}: not a JSON object")
            rows.append((n, row))
    return rows


def ndcg_at_k(ranked: Sequence[str], relevant: Mapping[str, int], k: int = 10) -> float:
    """nDCG@k with linear gains (BEIR / pytrec_eval ``ndcg_cut``)."""
    dcg = sum(relevant.get(d, 0) / math.log2(i + 2) for i, d in enumerate(ranked[:k]))
    ideal = sorted((s for s in relevant.values() if s > 0), reverse=True)[:k]
    idcg = sum(s / math.log2(i + 2) for i, s in enumerate(ideal))
    return dcg / idcg if idcg else 0.0


def recall_at_k(ranked: Sequence[str], relevant: Mapping[str, int], k: int = 100) -> float:
    """Share of the relevant documents (score > 0) among the first ``k``."""
    wanted = {d for d, s in relevant.items() if s > 0}
    return len(wanted.intersection(ranked[:k])) / len(wanted) if wanted else 0.0


def documents_of(hits: Sequence[SearchHit]) -> list[str]:
    """Document ids in order of their best chunk."""
    seen: dict[str, None] = {}
    for hit in hits:
        seen.setdefault(hit.document_id, None)
    return list(seen)


@dataclass(frozen=True)
class ModeResult:
    """The figures of one mode, as written to ``summary.json``."""

    ndcg_at_10: float
    recall_at_100: float
    p50_ms: float
    p95_ms: float
    stages: dict[str, float] = field(default_factory=dict)
    """Per-stage latency percentiles (``retrieve_p50_ms`` …) and, reranked, the mean passages
    scored; ``details.json`` carries them (``summary.json`` keeps the contract's four keys)."""
    ranking: dict[str, list[str]] = field(default_factory=dict)
    """Each query's documents, best first, as scored (identical ids dropped when asked)."""
    failed: int = 0
    """Queries whose search (or rerank) raised: scored as empty rankings."""
    errors: list[str] = field(default_factory=list)
    """The first few failures, ``qid: error``."""
    dense_truncated: int = 0
    """Queries whose embedding saw only their first ``max_dense_query_chars`` characters."""
    identical_dropped: int = 0
    """Hits dropped because their id was the query's own (``ignore_identical_ids``)."""
    rerank_fallbacks: int = 0
    """Queries whose rerank was refused, failed or timed out: scored in the retriever's order."""

    def counts(self) -> dict[str, object]:
        return {
            "failed_queries": self.failed,
            "errors": self.errors,
            "dense_truncated_queries": self.dense_truncated,
            "identical_ids_dropped": self.identical_dropped,
            "rerank_fallbacks": self.rerank_fallbacks,
        }

    def as_json(self) -> dict[str, float]:
        return {
            "ndcg@10": round(self.ndcg_at_10, 4),
            "recall@100": round(self.recall_at_100, 4),
            "p50_ms": round(self.p50_ms, 2),
            "p95_ms": round(self.p95_ms, 2),
        }


@dataclass(frozen=True)
class IngestResult:
    """``upserted`` documents (``chunks`` chunks) were new; the rest were already indexed unchanged."""

    documents: int
    upserted: int
    chunks: int
    seconds: float

    @property
    def docs_per_s(self) -> float:
        """Throughput of the documents actually written (chunked, encoded, embedded, indexed)."""
        return self.upserted / self.seconds if self.seconds and self.upserted else 0.0


class Evaluator:
    """Ingests one BEIR corpus into an in-process retriever and scores search modes on it.

    ``work_dir`` holds the database and index; reusing one skips re-embedding (an unchanged
    document is a no-op upsert). ``clock`` is injected for the latency figures.
    """

    def __init__(
        self,
        dataset: BeirDataset,
        work_dir: Path,
        embedder: Embedder | None,
        settings: RetrieverSettings | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.dataset = dataset
        self._work = work_dir
        self._embedder = embedder
        self._settings = settings or RetrieverSettings(data_dir=str(work_dir), kafka_enabled=False)
        self._clock = clock
        self._db: Database | None = None
        self._index: QdrantEdgeIndex | None = None
        self.service: RetrieverService | None = None

    async def open(self) -> None:
        self._work.mkdir(parents=True, exist_ok=True)
        self._db = Database(f"sqlite+aiosqlite:///{self._work / 'retriever.db'}")
        await self._db.migrate(MIGRATIONS)
        emb = self._embedder
        self._index = QdrantEdgeIndex(
            self._work / "index",
            dense_dim=emb.dimension if emb else None,
            dense_version=emb.version if emb else "",
            sparse_version=sparse_encoder(self._settings).version,
        )
        self.service = RetrieverService(self._db, self._index, self._settings, embedder=emb)
        await self.service.reconcile_index()

    async def close(self) -> None:
        if self._index is not None:
            await asyncio.to_thread(self._index.close)
        if self._db is not None:
            await self._db.dispose()

    async def ingest(self, progress: Callable[[int, int], None] = lambda done, total: None) -> IngestResult:
        """Upsert the corpus in batches; documents already indexed unchanged cost nothing."""
        assert self.service is not None, "call open() first"
        corpus = self.dataset.corpus
        started, chunks, upserted = self._clock(), 0, 0
        for first in range(0, len(corpus), _INGEST_BATCH):
            result = await self.service.upsert_documents(COLLECTION, corpus[first : first + _INGEST_BATCH])
            chunks += result.chunks
            upserted += result.upserted
            progress(min(first + _INGEST_BATCH, len(corpus)), len(corpus))
        return IngestResult(len(corpus), upserted, chunks, self._clock() - started)

    async def run_mode(
        self,
        mode: SearchMode,
        top_k: int = 200,
        rerank: Rerank | None = None,
        rerank_depth: int = 0,
        budget_ms: float | None = None,
        *,
        ignore_identical_ids: bool = True,
        progress: Callable[[int, int], None] = lambda done, total: None,
    ) -> ModeResult:
        """Search every query with ``mode``; with ``rerank``, its first ``rerank_depth`` documents
        (best chunk text and score each) are reordered and put before the rest. With ``budget_ms`` the
        reranker gets what the search left of it as its deadline. Latency covers both stages.
        A query whose search fails is scored as an empty ranking and counted; one whose rerank is
        refused, fails or times out keeps the retriever's order, as the gateway's RAG path does,
        and is counted in ``rerank_fallbacks``."""
        assert self.service is not None, "call open() first"
        ndcgs, recalls, latencies, searched, reranked, scored = [], [], [], [], [], []
        overran = failed = truncated = dropped = fallbacks = 0
        errors: list[str] = []
        rankings: dict[str, list[str]] = {}
        total = len(self.dataset.queries)
        for n, (qid, text) in enumerate(self.dataset.queries.items(), start=1):
            started = self._clock()
            try:
                result = await self.service.search(COLLECTION, text, top_k, mode, {})
                ranked = documents_of(result.hits)
                truncated += result.dense_truncated
                if ignore_identical_ids:
                    kept = [d for d in ranked if d != qid]
                    dropped += len(ranked) - len(kept)
                    ranked = kept
                found = self._clock()
                searched.append((found - started) * 1000.0)
                if rerank is not None and rerank_depth:
                    best: dict[str, tuple[str, str, float]] = {}
                    for hit in result.hits:
                        best.setdefault(
                            hit.document_id,
                            (
                                hit.document_id,
                                f"{hit.metadata.get('title', '')}\n{hit.text}".strip(),
                                hit.score,
                            ),
                        )
                    head = ranked[:rerank_depth]
                    left = None if budget_ms is None else max(0.0, budget_ms / 1000.0 - (found - started))
                    try:
                        answer = await rerank(text, [best[d] for d in head], left)
                    except Exception as exc:  # noqa: BLE001 - a refused or failed rerank keeps the order
                        fallbacks += 1
                        if len(errors) < _ERRORS_KEPT:
                            reason = " ".join(str(exc).split())[:300]
                            errors.append(
                                f"{qid}: rerank fell back to the retrieval order: {type(exc).__name__}: {reason}"
                            )
                    else:
                        ranked = answer.ids + [d for d in ranked if d not in set(answer.ids)]
                        reranked.append((self._clock() - found) * 1000.0)
                        scored.append(answer.scored)
                        overran += answer.overran
                latencies.append((self._clock() - started) * 1000.0)
            except Exception as exc:  # noqa: BLE001 - one query's failure is counted, never fatal
                failed += 1
                if len(errors) < _ERRORS_KEPT:
                    errors.append(f"{qid}: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
                ranked = []
            rankings[qid] = ranked
            ndcgs.append(ndcg_at_k(ranked, self.dataset.qrels[qid], 10))
            recalls.append(recall_at_k(ranked, self.dataset.qrels[qid], 100))
            progress(n, total)
        stages = {"retrieve_p50_ms": percentile(searched, 50), "retrieve_p95_ms": percentile(searched, 95)}
        if reranked:
            stages |= {
                "rerank_p50_ms": percentile(reranked, 50),
                "rerank_p95_ms": percentile(reranked, 95),
                "reranked_mean": statistics.fmean(scored),
                "rerank_overran": overran,
            }
        return ModeResult(
            statistics.fmean(ndcgs),
            statistics.fmean(recalls),
            percentile(latencies, 50),
            percentile(latencies, 95),
            stages,
            rankings,
            failed,
            errors,
            truncated,
            dropped,
            fallbacks,
        )


def write_trec_run(path: Path, ranking: Mapping[str, Sequence[str]], run_name: str) -> None:
    """``qid Q0 docid rank score run_name`` lines, ranks from 1, the score ``N - rank + 1``."""
    with open(path, "w", encoding="utf-8") as f:
        for qid, docs in ranking.items():
            for rank, doc in enumerate(docs, start=1):
                f.write(f"{qid} Q0 {doc} {rank} {len(docs) - rank + 1} {run_name}\n")


@dataclass(frozen=True)
class IngestionComparison:
    """The same ``documents`` ingested through the service (chunked, BM25-encoded, embedded,
    indexed, committed) and embedded by plain sentence-transformers ``encode`` (title and text,
    one vector a document), documents per second each."""

    documents: int
    service_docs_per_s: float
    sentence_transformers_docs_per_s: float

    def as_json(self) -> dict[str, float]:
        return {
            "documents": self.documents,
            "service_docs_per_s": round(self.service_docs_per_s, 2),
            "sentence_transformers_docs_per_s": round(self.sentence_transformers_docs_per_s, 2),
            "service_over_sentence_transformers": round(
                self.service_docs_per_s / self.sentence_transformers_docs_per_s, 3
            ),
        }


async def compare_ingestion(
    dataset: BeirDataset,
    embedder: Embedder,
    settings: RetrieverSettings,
    sample: int,
    clock: Callable[[], float] = time.perf_counter,
) -> IngestionComparison:
    """Ingest the first ``sample`` documents into a fresh scratch retriever (nothing cached) and
    time plain sentence-transformers on the same documents, with the same threads and batch."""
    from sentence_transformers import SentenceTransformer

    from forge_retriever.embed import bundled_minilm_path

    head = BeirDataset(dataset.name, dataset.corpus[:sample], {}, {})
    with tempfile.TemporaryDirectory(prefix="forge-ingest-bench-") as tmp:
        scratch = Evaluator(head, Path(tmp), embedder, settings.model_copy(update={"data_dir": tmp}))
        await scratch.open()
        try:
            ingested = await scratch.ingest()
        finally:
            await scratch.close()
    model = SentenceTransformer(settings.embedding_model_path or str(bundled_minilm_path()), device="cpu")
    model.max_seq_length = settings.embedding_max_tokens
    texts = [f"{d.title}\n{d.text}".strip() for d in head.corpus]
    model.encode(texts[: settings.embedding_batch_size], batch_size=settings.embedding_batch_size)  # warm up
    started = clock()
    model.encode(texts, batch_size=settings.embedding_batch_size, show_progress_bar=False)
    plain_s = clock() - started
    return IngestionComparison(len(texts), ingested.docs_per_s, len(texts) / plain_s)


def parse_modes(text: str) -> list[str]:
    """The comma-separated ``--modes`` list; unknown names are an error naming them."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    known = [*MODES, "hybrid_rerank"]
    unknown = [m for m in modes if m not in known]
    if not modes or unknown:
        raise ValueError(f"--modes: unknown {unknown or 'empty list'}; choose from {', '.join(known)}")
    return modes


def default_work_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="forge-eval-retrieval-"))
