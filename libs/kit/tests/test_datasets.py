"""`forge data fetch`: files land only with their pinned checksum, from a real HTTP server, a zip
archive or a mirror folder; anything else is refused with the file named and nothing installed."""

from __future__ import annotations

import hashlib
import http.server
import io
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from forge_kit import datasets
from forge_kit.datasets import DataError, DataFile, Dataset


class _Files(http.server.SimpleHTTPRequestHandler):
    requests: list[str] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        type(self).requests.append(self.path)
        super().do_GET()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, Path, list[str]]]:
    """An HTTP server on loopback serving ``tmp_path/www``: (base URL, folder, request log)."""
    www = tmp_path / "www"
    www.mkdir()
    requests: list[str] = []
    handler = type("Handler", (_Files,), {"requests": requests})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: handler(*a, directory=str(www)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", www, requests
    finally:
        httpd.shutdown()
        httpd.server_close()


def _file(path: str, data: bytes, **source: str) -> DataFile:
    return DataFile(path=path, size=len(data), sha256=hashlib.sha256(data).hexdigest(), **source)


def _set(*files: DataFile, name: str = "toy") -> dict[str, Dataset]:
    return {name: Dataset(name, f"sets/{name}", "a toy dataset", "CC0", files)}


def test_files_are_downloaded_checked_and_kept(server: tuple[str, Path, list[str]], tmp_path: Path) -> None:
    base, www, requests = server
    (www / "a.txt").write_bytes(b"alpha\n")
    (www / "b.jsonl").write_bytes(b'{"x": 1}\n')
    known = _set(
        _file("a.txt", b"alpha\n", url=f"{base}/a.txt"),
        _file("sub/b.jsonl", b'{"x": 1}\n', url=f"{base}/b.jsonl"),
    )
    root = tmp_path / "data"
    seen: list[tuple[str, int, int]] = []
    lines = datasets.fetch(["toy"], root=root, known=known, progress=lambda *a: seen.append(a))
    assert lines == ["toy: 2 fetched, 0 already present (15 bytes)"]
    assert (root / "sets/toy/a.txt").read_bytes() == b"alpha\n"
    assert (root / "sets/toy/sub/b.jsonl").read_bytes() == b'{"x": 1}\n'
    assert (root / "sets/toy/a.txt").stat().st_mode & 0o777 == 0o644  # sandboxed jobs read it
    assert ("toy/a.txt", 6, 6) in seen
    # A second fetch finds both in place and asks the server nothing (a file once fetched as
    # 0600 is made readable again).
    (root / "sets/toy/a.txt").chmod(0o600)
    count = len(requests)
    assert datasets.fetch(["toy"], root=root, known=known) == ["toy: 0 fetched, 2 already present (15 bytes)"]
    assert len(requests) == count
    assert (root / "sets/toy/a.txt").stat().st_mode & 0o777 == 0o644


def test_a_checksum_mismatch_is_refused_and_nothing_is_installed(
    server: tuple[str, Path, list[str]], tmp_path: Path
) -> None:
    base, www, _ = server
    (www / "a.txt").write_bytes(b"tampered\n")
    known = _set(_file("a.txt", b"alpha\n", url=f"{base}/a.txt"))
    root = tmp_path / "data"
    with pytest.raises(DataError, match=r"checksum mismatch for a.txt from http://127\.0\.0\.1:\d+/a.txt"):
        datasets.fetch(["toy"], root=root, known=known)
    folder = root / "sets" / "toy"
    assert not folder.exists() or list(folder.iterdir()) == []  # no file, no temporary left over


def test_a_changed_local_file_is_fetched_again(server: tuple[str, Path, list[str]], tmp_path: Path) -> None:
    base, www, _ = server
    (www / "a.txt").write_bytes(b"alpha\n")
    known = _set(_file("a.txt", b"alpha\n", url=f"{base}/a.txt"))
    root = tmp_path / "data"
    (root / "sets/toy").mkdir(parents=True)
    (root / "sets/toy/a.txt").write_bytes(b"edited\n")
    assert datasets.fetch(["toy"], root=root, known=known)[0].startswith("toy: 1 fetched")
    assert (root / "sets/toy/a.txt").read_bytes() == b"alpha\n"


def test_http_errors_name_the_address(server: tuple[str, Path, list[str]], tmp_path: Path) -> None:
    base, _, _ = server
    known = _set(_file("a.txt", b"alpha\n", url=f"{base}/missing.txt"))
    with pytest.raises(DataError, match="answered HTTP 404"):
        datasets.fetch(["toy"], root=tmp_path / "data", known=known)


def test_members_of_a_zip_archive_are_extracted_and_checked(
    server: tuple[str, Path, list[str]], tmp_path: Path
) -> None:
    base, www, requests = server
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        zf.writestr("toy/corpus.jsonl", b'{"_id": "1"}\n')
        zf.writestr("toy/qrels/test.tsv", b"q\td\t1\n")
    (www / "toy.zip").write_bytes(buffer.getvalue())
    url = f"{base}/toy.zip"
    known = _set(
        _file("corpus.jsonl", b'{"_id": "1"}\n', archive=url, member="toy/corpus.jsonl"),
        _file("qrels/test.tsv", b"q\td\t1\n", archive=url, member="toy/qrels/test.tsv"),
    )
    root = tmp_path / "data"
    datasets.fetch(["toy"], root=root, known=known)
    assert (root / "sets/toy/qrels/test.tsv").read_bytes() == b"q\td\t1\n"
    assert requests.count("/toy.zip") == 1  # one download serves every member
    escaping = _set(_file("x", b"x", archive=url, member="../x"), name="bad")
    with pytest.raises(DataError, match="outside its folder"):
        datasets.fetch(["bad"], root=root, known=escaping)


def test_a_mirror_is_copied_with_the_same_checks(tmp_path: Path) -> None:
    mirror = tmp_path / "mirror"
    (mirror / "sets/toy").mkdir(parents=True)
    (mirror / "sets/toy/a.txt").write_bytes(b"alpha\n")
    known = _set(_file("a.txt", b"alpha\n"))  # no public source: a mirror only
    root = tmp_path / "data"
    with pytest.raises(DataError, match="no public source"):
        datasets.fetch(["toy"], root=root, known=known)
    # Fetching everything, such a file is skipped and named, not an error.
    assert datasets.fetch(root=root, known=known) == [
        "toy: 0 fetched, 0 already present (6 bytes); skipped a.txt: no public address serves these "
        "exact bytes (forge data fetch toy --from DIR)"
    ]
    datasets.fetch(["toy"], root=root, mirror=mirror, known=known)
    assert (root / "sets/toy/a.txt").read_bytes() == b"alpha\n"
    (mirror / "sets/toy/a.txt").write_bytes(b"other\n")
    (root / "sets/toy/a.txt").unlink()
    with pytest.raises(DataError, match=r"checksum mismatch for a\.txt from mirror"):
        datasets.fetch(["toy"], root=root, mirror=mirror, known=known)
    with pytest.raises(DataError, match="not in the mirror"):
        datasets.fetch(["toy"], root=root, mirror=tmp_path / "empty", known=known)


def test_the_catalogue_pins_every_file_and_names_its_source() -> None:
    catalog = datasets.catalog()
    assert {"tinyshakespeare", "gsm8k", "humaneval", "mmlu", "bbh", "hh-rlhf", "scifact", "nfcorpus"} <= set(
        catalog
    )
    for ds in catalog.values():
        for f in ds.files:
            assert len(f.sha256) == 64 and f.size > 0, f
            assert (
                f.url.startswith("https://") or f.archive.startswith("https://") or "mirror" in ds.description
            )
    with pytest.raises(DataError, match=r"unknown dataset.*nope.*known: tinyshakespeare"):
        datasets.resolve(["nope"])
