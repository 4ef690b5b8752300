from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from forge_kit.db import Database
from forge_kit.paths import resolve_data_path
from forge_retriever.config import RetrieverSettings
from forge_retriever.documents import DocumentIn
from forge_retriever.embed import SentenceTransformerEmbedder
from forge_retriever.index import QdrantEdgeIndex
from forge_retriever.service import RetrieverService

MIGRATIONS = Path(__file__).parents[1] / "src" / "forge_retriever" / "migrations"
# The data folder (`forge data fetch scifact`); the BEIR copies are never copied into the repo.
SCIFACT = resolve_data_path("beir/scifact")
SCIFACT_DOCS = 50


@dataclass(frozen=True)
class SciFactSample:
    """The first SCIFACT_DOCS corpus documents and the test queries whose qrels point at them."""

    documents: list[DocumentIn]
    relevant: dict[str, tuple[str, set[str]]]  # query id -> (query text, relevant doc ids in the sample)


@pytest.fixture(scope="session")
def scifact() -> SciFactSample:
    if not (SCIFACT / "corpus.jsonl").exists():
        pytest.fail(f"SciFact data not found at {SCIFACT} (set FORGE_TEST_DATA to the shared data folder)")
    documents = []
    with open(SCIFACT / "corpus.jsonl", encoding="utf-8") as corpus:
        for line, _ in zip(corpus, range(SCIFACT_DOCS), strict=False):
            row = json.loads(line)
            documents.append(DocumentIn(id=row["_id"], title=row.get("title", ""), text=row["text"]))
    ids = {d.id for d in documents}
    with open(SCIFACT / "queries.jsonl", encoding="utf-8") as f:
        queries = {row["_id"]: row["text"] for row in map(json.loads, f)}
    relevant: dict[str, tuple[str, set[str]]] = {}
    with open(SCIFACT / "qrels" / "test.tsv", encoding="utf-8") as f:
        for row in csv.DictReader(f, delimiter="\t"):
            if row["corpus-id"] in ids and int(row["score"]) > 0:
                relevant.setdefault(row["query-id"], (queries[row["query-id"]], set()))[1].add(
                    row["corpus-id"]
                )
    assert relevant, "no SciFact test query has a relevant document among the sample"
    return SciFactSample(documents, relevant)


@pytest.fixture
def settings(tmp_path: Path) -> RetrieverSettings:
    return RetrieverSettings(
        data_dir=str(tmp_path), kafka_enabled=False, chunk_tokens=64, chunk_overlap_tokens=16
    )


@pytest.fixture
def db_migrations() -> Path:
    """This service's migrations, for forge_kit.testing's ``db`` fixture."""
    return MIGRATIONS


@pytest.fixture
def index(tmp_path: Path) -> Iterator[QdrantEdgeIndex]:
    idx = QdrantEdgeIndex(tmp_path / "index")
    yield idx
    idx.close()


@pytest.fixture
async def service(db: Database, index: QdrantEdgeIndex, settings: RetrieverSettings) -> RetrieverService:
    svc = RetrieverService(db, index, settings)
    await svc.reconcile_index()
    return svc


@pytest.fixture(scope="session")
def minilm() -> SentenceTransformerEmbedder:
    """The real bundled MiniLM, loaded once per test session (a few seconds on CPU)."""
    return SentenceTransformerEmbedder(batch_size=16, query_cache_size=8)


@pytest.fixture
def dense_index(tmp_path: Path, minilm: SentenceTransformerEmbedder) -> Iterator[QdrantEdgeIndex]:
    idx = QdrantEdgeIndex(tmp_path / "dense-index", dense_dim=minilm.dimension, dense_version=minilm.version)
    yield idx
    idx.close()


@pytest.fixture
async def dense_service(
    db: Database,
    dense_index: QdrantEdgeIndex,
    settings: RetrieverSettings,
    minilm: SentenceTransformerEmbedder,
) -> RetrieverService:
    svc = RetrieverService(db, dense_index, settings, embedder=minilm)
    await svc.reconcile_index()
    return svc
