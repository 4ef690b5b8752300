"""The datasets the platform uses: where they live (``FORGE_DATA_DIR``) and how they get there.

Every file of every dataset is listed in ``datasets.json`` (beside this module) with the public
address it comes from and the sha256 and size it must have. :func:`fetch` brings a dataset into
the data folder either by downloading each file (or the zip archive holding it) or by copying it
from a mirror folder that holds the same layout; either way a file lands only after its checksum
matched, written to a temporary name and renamed into place, so a failed or tampered transfer
leaves nothing half-written. Files already present with the pinned checksum are kept.

The data folder is ``$FORGE_DATA_DIR`` when set, else ``var/datasets`` in the checkout (apart from the services' own state in ``var/data``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path, PurePosixPath

import httpx

from forge_kit.paths import data_dir

#: Where the eval service's benchmark suites read their pinned hashes (written after a fetch).
BENCHMARKS_MANIFEST = "benchmarks/MANIFEST.tsv"
_CHUNK = 1 << 20
_DOWNLOAD_TIMEOUT = httpx.Timeout(30.0, read=120.0)

#: ``progress(description, done_bytes, total_bytes)``, called as bytes arrive or are checked.
Progress = Callable[[str, int, int], None]


class DataError(Exception):
    """A dataset could not be fetched: unknown name, checksum mismatch, missing source."""


@dataclass(frozen=True)
class DataFile:
    """One file of a dataset: ``path`` inside the dataset's folder, where it comes from."""

    path: str
    size: int
    sha256: str
    url: str = ""
    archive: str = ""
    member: str = ""


@dataclass(frozen=True)
class Dataset:
    name: str
    folder: str
    description: str
    license: str
    files: tuple[DataFile, ...]

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


@cache
def catalog() -> dict[str, Dataset]:
    """Every dataset of ``datasets.json`` by name."""
    raw = json.loads(resources.files("forge_kit").joinpath("datasets.json").read_text())
    found: dict[str, Dataset] = {}
    for name, spec in raw["datasets"].items():
        files = tuple(DataFile(**f) for f in spec["files"])
        for f in files:
            _safe_relative(f.path)
        found[name] = Dataset(name, spec["folder"], spec["description"], spec["license"], files)
    return found


def resolve(names: Iterable[str], known: Mapping[str, Dataset] | None = None) -> list[Dataset]:
    """The datasets named (all of them for none) among ``known`` (the catalogue by default),
    refusing unknown names with the known ones."""
    known = catalog() if known is None else known
    wanted = list(names) or list(known)
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise DataError(f"unknown dataset(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return [known[n] for n in dict.fromkeys(wanted)]


def _safe_relative(path: str) -> PurePosixPath:
    rel = PurePosixPath(path)
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        raise DataError(f"refusing a dataset path outside its folder: {path!r}")
    return rel


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def is_present(dataset: Dataset, root: Path, file: DataFile) -> bool:
    """Whether ``file`` is in place with its pinned size and checksum."""
    target = root / dataset.folder / file.path
    return target.is_file() and target.stat().st_size == file.size and _sha256(target) == file.sha256


@contextlib.contextmanager
def _staged(target: Path) -> Iterator[Path]:
    """A temporary file beside ``target``, renamed onto it when the block succeeds."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        # Public data, read by jobs that run as another user: not mkstemp's 0600.
        tmp.chmod(0o644)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _world_readable(path: Path) -> None:
    """Make a data file readable by every user (jobs run as their own)."""
    if path.stat().st_mode & 0o044 != 0o044:
        path.chmod(path.stat().st_mode | 0o044)


def _check(file: DataFile, path: Path, origin: str) -> None:
    actual = _sha256(path)
    if actual != file.sha256:
        raise DataError(
            f"checksum mismatch for {file.path} from {origin}: expected sha256 {file.sha256}, got {actual}; "
            "the file was not installed"
        )


def _download(client: httpx.Client, url: str, dest: Path, label: str, progress: Progress | None) -> None:
    with client.stream("GET", url) as response:
        if response.status_code != 200:
            raise DataError(f"{label}: GET {url} answered HTTP {response.status_code}")
        total = int(response.headers.get("content-length") or 0)
        done = 0
        with open(dest, "wb") as out:
            for chunk in response.iter_bytes(_CHUNK):
                out.write(chunk)
                done += len(chunk)
                if progress:
                    progress(label, done, total)


def _from_mirror(dataset: Dataset, file: DataFile, mirror: Path, target: Path) -> None:
    source = mirror / dataset.folder / file.path
    if not source.is_file():
        raise DataError(f"{dataset.name}: {file.path} is not in the mirror {mirror}")
    with _staged(target) as tmp:
        shutil.copyfile(source, tmp)
        _check(file, tmp, f"mirror {mirror}")


def _from_archive(file: DataFile, archive: Path, target: Path) -> None:
    with zipfile.ZipFile(archive) as zf:
        try:
            info = zf.getinfo(str(_safe_relative(file.member)))
        except KeyError:
            raise DataError(f"{file.path}: {file.member} is not in {file.archive}") from None
        with _staged(target) as tmp:
            with zf.open(info) as src, open(tmp, "wb") as out:
                shutil.copyfileobj(src, out, _CHUNK)
            _check(file, tmp, file.archive)


def fetch(
    names: Iterable[str] = (),
    *,
    root: Path | None = None,
    mirror: Path | None = None,
    client: httpx.Client | None = None,
    progress: Progress | None = None,
    known: Mapping[str, Dataset] | None = None,
) -> list[str]:
    """Bring the named datasets (all for none) into ``root`` (the data folder by default), from
    ``mirror`` when given, else from their public addresses. Returns one line per dataset saying
    what was done; raises :class:`DataError` naming the first file that could not be had — except,
    when fetching everything (no names) without a mirror, files no public address serves with
    these exact bytes, which are skipped and named in the dataset's line. ``known`` replaces the
    catalogue (datasets of one's own)."""
    root = root or data_dir()
    names = list(names)
    datasets = resolve(names, known)
    own_client = client is None
    http = client or httpx.Client(timeout=_DOWNLOAD_TIMEOUT, follow_redirects=True)
    lines: list[str] = []
    try:
        with tempfile.TemporaryDirectory(prefix="forge-data-") as scratch:
            archives: dict[str, Path] = {}
            for dataset in datasets:
                fetched = 0
                skipped: list[str] = []
                for file in dataset.files:
                    if is_present(dataset, root, file):
                        _world_readable(root / dataset.folder / file.path)  # one fetched as 0600
                        continue
                    target = root / dataset.folder / file.path
                    label = f"{dataset.name}/{file.path}"
                    if mirror is not None:
                        _from_mirror(dataset, file, mirror, target)
                    elif file.archive:
                        if file.archive not in archives:
                            archives[file.archive] = Path(scratch) / f"archive-{len(archives)}.zip"
                            _download(http, file.archive, archives[file.archive], file.archive, progress)
                        _from_archive(file, archives[file.archive], target)
                    elif file.url:
                        with _staged(target) as tmp:
                            _download(http, file.url, tmp, label, progress)
                            _check(file, tmp, file.url)
                    elif not names:
                        skipped.append(file.path)
                        continue
                    else:
                        raise DataError(
                            f"{label} has no public source with these exact bytes ({dataset.description}); "
                            "fetch it from a mirror: forge data fetch --from DIR"
                        )
                    fetched += 1
                    if progress:
                        progress(label, file.size, file.size)
                kept = len(dataset.files) - fetched - len(skipped)
                line = f"{dataset.name}: {fetched} fetched, {kept} already present ({dataset.size:,} bytes)"
                if skipped:
                    line += (
                        f"; skipped {', '.join(skipped)}: no public address serves these exact bytes "
                        f"(forge data fetch {dataset.name} --from DIR)"
                    )
                lines.append(line)
        if known is None and any(d.folder.startswith("benchmarks/") for d in datasets):
            write_benchmarks_manifest(root)
    finally:
        if own_client:
            http.close()
    return lines


def write_benchmarks_manifest(root: Path) -> Path:
    """``benchmarks/MANIFEST.tsv``: the pinned hash of every benchmark file present, which the
    eval service checks before it runs a suite (data that changed under a pin refuses to run)."""
    rows = ["path\tbytes\trows\tsha256_16"]
    for dataset in catalog().values():
        if not dataset.folder.startswith("benchmarks/"):
            continue
        suite = dataset.folder.removeprefix("benchmarks/")
        for file in dataset.files:
            if (root / dataset.folder / file.path).is_file():
                rows.append(f"{suite}/{file.path}\t{file.size}\t\t{file.sha256[:16]}")
    path = root / BENCHMARKS_MANIFEST
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(rows) + "\n")
    return path
