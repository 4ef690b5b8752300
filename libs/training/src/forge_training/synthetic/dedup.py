"""Near-duplicate removal and decontamination with MinHash LSH (``datasketch``).

Texts are normalised (lower case, words and numbers only) and shingled into word ``ngram`` s;
each gets a seeded MinHash of ``num_perm`` permutations, so results repeat exactly.

- **Decontamination** (:class:`Decontaminator`): every text field of at least ``min_words``
  words of every record of the eval benchmarks' **test** splits is indexed, one LSH per
  benchmark. Where the data is comes from the eval service's task files
  (``services/eval/src/forge_eval/tasks/*.yaml``: ``dataset.path`` glob under
  ``$FORGE_DATA_DIR/<root>``, ``format`` jsonl / jsonl.gz / json with ``records_key`` / csv with
  ``columns``); tasks whose split is not ``test`` (the perplexity corpus) are listed as skipped.
  A problem whose question or kept solution has estimated Jaccard at least ``threshold``
  (default 0.5) with a benchmark text is removed and counted under that benchmark.
- **Within the set** (:func:`dedup`): problems in order; one whose question is within
  ``within_threshold`` (default 0.9: template problems share most of their wording and differ in
  their numbers, which are kept in the shingles) of an earlier kept one is removed.
"""

from __future__ import annotations

import csv
import glob
import gzip
import io
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from datasketch import MinHash, MinHashLSH

from forge_training.synthetic.verify import Verified

_WORD = re.compile(r"[a-z]+|\d+(?:\.\d+)?")
MAX_BENCHMARK_FILE_BYTES = 256 << 20


def shingles(text: str, ngram: int = 3) -> set[bytes]:
    """The word ``ngram`` s of the normalised text (the whole text when it is shorter)."""
    words = _WORD.findall(text.lower())
    if len(words) <= ngram:
        return {" ".join(words).encode()} if words else set()
    return {" ".join(words[i : i + ngram]).encode() for i in range(len(words) - ngram + 1)}


def minhash(text: str, ngram: int = 3, num_perm: int = 128) -> MinHash:
    m = MinHash(num_perm=num_perm, seed=1)
    grams = shingles(text, ngram)
    if grams:
        m.update_batch(sorted(grams))
    return m


# --- the benchmarks' test splits --------------------------------------------------------------


@dataclass(frozen=True)
class BenchmarkSource:
    """One eval task's test split: its name and the texts to check against."""

    name: str
    texts: tuple[str, ...]


def _records(path: Path, ds: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    if path.stat().st_size > MAX_BENCHMARK_FILE_BYTES:
        raise ValueError(f"{path}: larger than {MAX_BENCHMARK_FILE_BYTES} bytes")
    fmt = ds.get("format", "")
    raw = gzip.decompress(path.read_bytes()) if fmt == "jsonl.gz" else path.read_bytes()
    text = raw.decode("utf-8")
    if fmt in ("jsonl", "jsonl.gz"):
        yield from (json.loads(line) for line in text.splitlines() if line.strip())
    elif fmt == "json":
        data = json.loads(text)
        yield from data[ds["records_key"]] if ds.get("records_key") else data
    elif fmt == "csv":
        columns = list(ds.get("columns") or [])
        for row in csv.reader(io.StringIO(text)):
            yield dict(zip(columns, row, strict=False)) if columns else {str(i): v for i, v in enumerate(row)}
    else:
        raise ValueError(f"{path}: format {fmt!r} is not read for decontamination")


def default_tasks_dir() -> Path:
    """The eval service's task folder in this checkout (``FORGE_EVAL_TASKS_DIR`` overrides)."""
    if os.environ.get("FORGE_EVAL_TASKS_DIR"):
        return Path(os.environ["FORGE_EVAL_TASKS_DIR"])
    return Path(__file__).resolve().parents[5] / "services" / "eval" / "src" / "forge_eval" / "tasks"


def benchmark_sources(
    tasks_dir: Path, data_dir: Path, *, min_words: int = 8
) -> tuple[list[BenchmarkSource], dict[str, str]]:
    """The test splits named by every ``*.yaml`` task of ``tasks_dir`` (the eval service's task
    folder), read under ``data_dir``; and the tasks skipped, with why. A task whose data is
    missing raises FileNotFoundError: decontaminating against nothing would pass silently."""
    sources, skipped = [], {}
    files = sorted(tasks_dir.glob("*.yaml"))
    if not files:
        raise FileNotFoundError(f"no eval task files (*.yaml) in {tasks_dir}")
    for task_file in files:
        task = yaml.safe_load(task_file.read_text())
        ds = task.get("dataset") or {}
        name = str(task.get("name", task_file.stem))
        if ds.get("split") != "test":
            skipped[name] = f"split {ds.get('split')!r} is not a test split"
            continue
        root = data_dir / str(ds.get("root", "benchmarks"))
        paths = sorted(Path(p) for p in glob.glob(str(root / ds["path"])))
        if not paths:
            raise FileNotFoundError(f"eval task {name}: no data at {root / ds['path']}")
        texts = [
            value
            for path in paths
            for record in _records(path, ds)
            for value in record.values()
            if isinstance(value, str) and len(value.split()) >= min_words
        ]
        sources.append(BenchmarkSource(name, tuple(texts)))
    return sources, skipped


class Decontaminator:
    """One LSH per benchmark split (tasks reading the same split share it); :meth:`match` names the
    first source a text is close to."""

    def __init__(
        self,
        sources: Sequence[BenchmarkSource],
        *,
        threshold: float = 0.5,
        ngram: int = 3,
        num_perm: int = 128,
    ) -> None:
        self.ngram, self.num_perm, self.threshold = ngram, num_perm, threshold
        self.texts = {source.name: source.texts for source in sources}
        self.indexes: dict[str, MinHashLSH] = {}
        self.sizes: dict[str, int] = {}
        # Tasks that read the same split (``mmlu`` and ``mmlu_cloze``) share one index: built once.
        built: dict[tuple[str, ...], MinHashLSH] = {}
        for source in sources:
            self.sizes[source.name] = len(source.texts)
            if source.texts in built:
                self.indexes[source.name] = built[source.texts]
                continue
            lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
            hashes = MinHash.bulk(
                [sorted(shingles(t, ngram)) for t in source.texts], num_perm=num_perm, seed=1
            )
            with lsh.insertion_session() as session:
                for i, m in enumerate(hashes):
                    if not m.is_empty():
                        session.insert(f"{source.name}:{i}", m, check_duplication=False)
            self.indexes[source.name] = built[source.texts] = lsh

    def match(self, texts: Sequence[str]) -> tuple[str, str] | None:
        """(source, matched key) of the first benchmark text near any of ``texts``, or None. LSH
        candidates are confirmed by their exact Jaccard similarity (LSH alone lets through pairs
        below the threshold)."""
        for text in texts:
            m = minhash(text, self.ngram, self.num_perm)
            if m.is_empty():
                continue
            grams = shingles(text, self.ngram)
            queried: set[int] = set()
            for name, lsh in self.indexes.items():
                if id(lsh) in queried:  # a shared index: its first source answered for it
                    continue
                queried.add(id(lsh))
                for key in sorted(lsh.query(m), key=lambda k: int(k.rsplit(":", 1)[1])):
                    other = shingles(self.texts[name][int(key.rsplit(":", 1)[1])], self.ngram)
                    if _jaccard(grams, other) >= self.threshold:
                        return name, key
        return None


@dataclass
class DedupReport:
    """Problems kept, removed (with the reason: ``duplicate of <id>`` or ``benchmark <name>
    (<key>)``) and counts per source."""

    kept: list[Verified] = field(default_factory=list)
    removed: list[tuple[Verified, str]] = field(default_factory=list)
    within_set: int = 0
    by_benchmark: dict[str, int] = field(default_factory=dict)

    def counts(self) -> dict[str, object]:
        return {
            "in": len(self.kept) + len(self.removed),
            "kept": len(self.kept),
            "removed_within_set": self.within_set,
            "removed_by_benchmark": dict(sorted(self.by_benchmark.items())),
        }


def dedup(
    items: Sequence[Verified],
    decontaminator: Decontaminator | None,
    *,
    within_threshold: float = 0.9,
    ngram: int = 3,
    num_perm: int = 128,
    texts: Callable[[Verified], Sequence[str]] | None = None,
) -> DedupReport:
    """Remove benchmark matches (every source counted, checked first) and near duplicates of an
    earlier kept problem, in order. ``texts`` says what of a problem is compared with the
    benchmarks (default: the question and its first kept solution, annotations stripped)."""
    report = DedupReport(by_benchmark=dict.fromkeys(decontaminator.indexes, 0) if decontaminator else {})
    seen = MinHashLSH(threshold=within_threshold, num_perm=num_perm)
    kept_grams: dict[str, set[bytes]] = {}
    checked = texts or (lambda v: (v.problem.question, v.solutions[0].plain() if v.solutions else ""))
    for item in items:
        if decontaminator is not None:
            hit = decontaminator.match([t for t in checked(item) if t])
            if hit is not None:
                report.removed.append((item, f"benchmark {hit[0]} ({hit[1]})"))
                report.by_benchmark[hit[0]] += 1
                continue
        m = minhash(item.problem.question, ngram, num_perm)
        grams = shingles(item.problem.question, ngram)
        candidates = sorted(seen.query(m)) if not m.is_empty() else []
        near = [k for k in candidates if _jaccard(grams, kept_grams[k]) >= within_threshold]
        if near:
            report.removed.append((item, f"duplicate of {sorted(near)[0]}"))
            report.within_set += 1
            continue
        if not m.is_empty():
            key = f"{item.problem.id}#{len(report.kept)}"
            seen.insert(key, m, check_duplication=False)
            kept_grams[key] = grams
        report.kept.append(item)
    return report


def jaccard(a: str, b: str, ngram: int = 3) -> float:
    """The exact Jaccard similarity of two texts' shingles (for reports and tests)."""
    return _jaccard(shingles(a, ngram), shingles(b, ngram))


def _jaccard(x: set[bytes], y: set[bytes]) -> float:
    return len(x & y) / len(x | y) if x | y else 1.0


__all__ = [
    "BenchmarkSource",
    "Decontaminator",
    "DedupReport",
    "benchmark_sources",
    "dedup",
    "jaccard",
    "minhash",
    "shingles",
]
