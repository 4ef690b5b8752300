"""Pinned run specs: which suites exist, what their data hashes to, and the spec hash.

A run spec names everything that decides a run's results: the suite, the content hash of every
dataset file it reads, the model, the sampling parameters, the seed, the example limit and the
scorer version. Its hash is the sha256 of its canonical JSON (sorted keys, no whitespace), so two
runs with equal hashes are comparable example by example.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from forge_kit import errors

#: Files in a suite folder that are not data (licences, provenance notes).
NOT_DATA = frozenset({"LICENSE", "README.md", "SOURCE.txt", "banned_urls.txt"})
DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".jsonl.gz", ".json.gz", ".txt")
MANIFEST = "MANIFEST.tsv"


@dataclass(frozen=True)
class OptionSpec:
    """A run-spec option: its type, default and allowed range."""

    kind: type[int] | type[float]
    default: int | float
    low: float
    high: float


#: Options RunSuite accepts; omitted ones take the default, so "omitted" and "explicit default" hash alike.
OPTIONS: dict[str, OptionSpec] = {
    "temperature": OptionSpec(float, 0.0, 0.0, 2.0),
    "top_p": OptionSpec(float, 1.0, 1e-9, 1.0),
    "max_tokens": OptionSpec(int, 256, 1, 32768),
    "num_fewshot": OptionSpec(int, 0, 0, 64),
}


def normalize_options(options: Mapping[str, str]) -> dict[str, int | float]:
    """Typed sampling parameters with defaults filled in; a bad key or value names ``options.<key>``."""
    values: dict[str, int | float] = {name: spec.default for name, spec in OPTIONS.items()}
    for key, raw in options.items():
        spec = OPTIONS.get(key)
        if spec is None:
            raise errors.ValidationError(
                f"options.{key}", f"unknown option; known: {', '.join(sorted(OPTIONS))}"
            )
        try:
            value: int | float = spec.kind(raw.strip())
        except ValueError:
            raise errors.ValidationError(
                f"options.{key}", f"must be {'an integer' if spec.kind is int else 'a number'}, got {raw!r}"
            ) from None
        if isinstance(value, float) and not math.isfinite(value):
            raise errors.ValidationError(f"options.{key}", "must be finite")
        if not spec.low <= value <= spec.high:
            raise errors.ValidationError(f"options.{key}", f"must be between {spec.low:g} and {spec.high:g}")
        values[key] = value
    return values


@dataclass(frozen=True)
class RunSpec:
    """Everything that decides a run's results."""

    suite: str
    datasets: dict[str, str]
    model_name: str
    model_version: str
    sampling: dict[str, int | float]
    seed: int
    limit: int
    scorer_version: str
    tier: str = "full"
    """``full`` or ``smoke`` (each task's stratified subset)."""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> RunSpec:
        return cls(**data)  # type: ignore[arg-type]

    def canonical_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    def spec_hash(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()

    def differences(
        self, other: RunSpec, *, ignore: frozenset[str] = frozenset({"model_name", "model_version"})
    ) -> list[str]:
        """Fields that differ from ``other`` (the model is ignored by default: comparisons pair models)."""
        mine, theirs = self.to_dict(), other.to_dict()
        return [key for key in sorted(mine) if key not in ignore and mine[key] != theirs[key]]


class SuiteCatalog(Protocol):
    """Which suites exist and what their data hashes to. Called by ``RunService.run_suite`` to
    validate the suite and pin the content hashes in the run spec."""

    @property
    def root(self) -> Path:
        """Where the data is (named in errors)."""

    def suites(self) -> list[str]:
        """Suite names whose data is present."""

    def dataset_hashes(self, suite: str) -> dict[str, str]:
        """``{data file or dataset: sha256}``; raises when data no longer matches a pinned hash."""


class BenchmarkCatalog:
    """The suites under a benchmarks folder and the content hashes of their data files.

    File hashes are computed (and cached by size and mtime) and checked against the folder's
    ``MANIFEST.tsv`` where it pins one: data that changed under a pinned hash refuses to run.
    """

    def __init__(self, root: Path) -> None:
        self._root = root
        self._cache: dict[Path, tuple[int, int, str]] = {}
        self._manifest = self._read_manifest()

    @property
    def root(self) -> Path:
        return self._root

    def _read_manifest(self) -> dict[str, str]:
        path = self.root / MANIFEST
        if not path.is_file():
            return {}
        pinned: dict[str, str] = {}
        for line in path.read_text().splitlines()[1:]:
            cols = line.split("\t")
            if len(cols) >= 4 and cols[3] and "*" not in cols[0]:
                pinned[cols[0]] = cols[3]
        return pinned

    def suites(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and self.data_files(p.name))

    def data_files(self, suite: str) -> list[Path]:
        folder = self.root / suite
        return sorted(
            p
            for p in folder.rglob("*")
            if p.is_file() and p.name not in NOT_DATA and p.name.endswith(DATA_SUFFIXES)
        )

    def dataset_hashes(self, suite: str) -> dict[str, str]:
        """``{relative path: sha256}`` of every data file of ``suite``."""
        hashes: dict[str, str] = {}
        for path in self.data_files(suite):
            rel = path.relative_to(self.root).as_posix()
            digest = self._sha256(path)
            pinned = self._manifest.get(rel)
            if pinned is not None and not digest.startswith(pinned):
                raise errors.ConflictError(
                    f"dataset {rel} has sha256 {digest[:16]}…, but {MANIFEST} pins {pinned}: the data changed"
                )
            hashes[rel] = digest
        return hashes

    def _sha256(self, path: Path) -> str:
        stat = path.stat()
        cached = self._cache.get(path)
        if cached is not None and cached[:2] == (stat.st_size, stat.st_mtime_ns):
            return cached[2]
        digest = hashlib.sha256()
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        self._cache[path] = (stat.st_size, stat.st_mtime_ns, digest.hexdigest())
        return digest.hexdigest()
