"""Image-text samples in shards: WebDataset tar files (written here with the standard library's
``tarfile``) and Parquet files (read with pyarrow), one reader for both.

A :class:`Sample` is one training item: ``kind`` (``caption``, ``document``, ``chat`` or
``text``), its ``segments`` (``{"text": str}`` and ``{"image": i}``, in order: the image
placeholders of the token stream) or its chat ``messages`` (OpenAI content parts, an image part
``{"type": "image"}``), the image bytes, and free metadata.

WebDataset layout (what :class:`ShardWriter` writes; members of one sample share the key before
the first dot, in order)::

    <key>.json      {"kind", "segments" | "messages", "meta"}
    <key>.0.png     image 0 (any of png / jpg / jpeg / webp / gif)
    <key>.1.png     image 1 ...

Real sets read through the same :class:`ShardReader`:

- **LAION-style captions** (img2dataset's WebDataset output): ``<key>.jpg`` (or png/webp) +
  ``<key>.txt`` (+ ``<key>.json`` metadata, kept as ``meta``) become a ``caption`` sample with
  segments ``[image 0, text]``.
- **OBELICS-style interleaved documents** (Parquet): columns ``texts`` (list of string or null)
  and ``images`` (list of null, raw bytes, or ``{"bytes": ...}`` structs as Hugging Face's Image
  feature stores them), aligned by position with exactly one of the two set at each; they become
  a ``document`` sample, text and images in that order. An image given only as a URL (OBELICS as
  published) is refused for that row: download the images first (img2dataset).
  Optional ``meta`` column: a JSON string or struct kept as metadata.

Order is deterministic: shards sorted by name, samples in file order; a sample's index in
:class:`ShardReader` is its position in that order, which the step samplers of
:mod:`forge_training.data` permute per epoch and whose state they checkpoint (resume is exact).
A sample that cannot be read raises :class:`ItemError` naming it (shard and key); the callers
drop that item and keep the rest of the batch.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

IMAGE_EXTS = ("png", "jpg", "jpeg", "webp", "gif")
KINDS = ("caption", "document", "chat", "text")
#: Largest JSON or caption member read (bytes).
MAX_TEXT_BYTES = 1 << 20


class ItemError(ValueError):
    """A sample that cannot be used; ``item`` names it (``shard:key``)."""

    def __init__(self, item: str, reason: str) -> None:
        super().__init__(f"{item}: {reason}")
        self.item, self.reason = item, reason


@dataclass
class Sample:
    key: str
    kind: str
    segments: list[dict[str, Any]] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    images: list[bytes] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        body: dict[str, Any] = {"kind": self.kind, "meta": self.meta}
        if self.kind == "chat":
            body["messages"] = self.messages
        else:
            body["segments"] = self.segments
        return body


class ShardWriter:
    """Writes samples to ``<dir>/<prefix>-000000.tar``, ... with ``per_shard`` samples each.
    Members carry fixed metadata (mtime 0, uid 0, mode 0644), so the same samples give the same
    bytes."""

    def __init__(self, directory: Path, prefix: str = "shard", per_shard: int = 1000) -> None:
        self.directory, self.prefix, self.per_shard = directory, prefix, per_shard
        directory.mkdir(parents=True, exist_ok=True)
        self._tar: tarfile.TarFile | None = None
        self._count = 0
        self.paths: list[Path] = []

    def _add(self, name: str, data: bytes) -> None:
        assert self._tar is not None
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = len(data), 0, 0o644
        self._tar.addfile(info, io.BytesIO(data))

    def write(self, sample: Sample, image_ext: str = "png") -> None:
        if "." in sample.key or "/" in sample.key:
            raise ValueError(f"sample key {sample.key!r} may not contain '.' or '/'")
        if self._count % self.per_shard == 0:
            self.close()
            path = self.directory / f"{self.prefix}-{len(self.paths):06d}.tar"
            self._tar = tarfile.open(path, "w", format=tarfile.USTAR_FORMAT)  # noqa: SIM115 - closed by close()
            self.paths.append(path)
        self._add(f"{sample.key}.json", json.dumps(sample.record(), sort_keys=True).encode())
        for i, data in enumerate(sample.images):
            self._add(f"{sample.key}.{i}.{image_ext}", data)
        self._count += 1

    def close(self) -> None:
        if self._tar is not None:
            self._tar.close()
            self._tar = None

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class _TarEntry:
    path: Path
    key: str
    members: tuple[tuple[str, int, int], ...]
    """(extension, data offset, size) of each member, in file order."""


@dataclass(frozen=True)
class _RowEntry:
    path: Path
    row: int


def _tar_entries(path: Path) -> list[_TarEntry]:
    groups: dict[str, list[tuple[str, int, int]]] = {}
    try:
        with tarfile.open(path, "r:") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                name = member.name.rsplit("/", 1)[-1]
                key, dot, ext = name.partition(".")
                if dot:
                    groups.setdefault(key, []).append((ext.lower(), member.offset_data, member.size))
    except tarfile.TarError as exc:
        raise ItemError(str(path), f"unreadable tar shard ({exc})") from None
    return [_TarEntry(path, key, tuple(members)) for key, members in groups.items()]


def _row_entries(path: Path) -> list[_RowEntry]:
    import pyarrow.parquet as pq

    try:
        rows = pq.ParquetFile(path).metadata.num_rows
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several error types
        raise ItemError(str(path), f"unreadable Parquet shard ({exc})") from None
    return [_RowEntry(path, i) for i in range(rows)]


def shard_files(source: Path) -> list[Path]:
    """The shards of ``source``: a ``.tar``/``.parquet`` file, or a directory's, sorted by name."""
    if source.is_file():
        return [source]
    if not source.is_dir():
        raise FileNotFoundError(f"{source} does not exist")
    files = sorted(p for p in source.iterdir() if p.suffix in (".tar", ".parquet") and p.is_file())
    if not files:
        raise FileNotFoundError(f"{source} holds no .tar or .parquet shard")
    return files


class ShardReader:
    """Random access to the samples of a set of shards, by index in the deterministic order."""

    def __init__(self, shards: Sequence[Path], max_image_bytes: int = 8 * 1024 * 1024) -> None:
        self.shards = list(shards)
        self.max_image_bytes = max_image_bytes
        self._entries: list[_TarEntry | _RowEntry] = []
        for path in self.shards:
            if path.suffix == ".parquet":
                self._entries.extend(_row_entries(path))
            else:
                self._entries.extend(_tar_entries(path))
        self._table: tuple[Path, Any] | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def name(self, index: int) -> str:
        entry = self._entries[index]
        key = entry.key if isinstance(entry, _TarEntry) else f"row {entry.row}"
        return f"{entry.path.name}:{key}"

    def read(self, index: int) -> Sample:
        """The sample at ``index``; :class:`ItemError` naming it if it cannot be used."""
        entry = self._entries[index]
        if isinstance(entry, _TarEntry):
            return self._read_tar(entry)
        return self._read_row(entry)

    def read_many(self, indices: Sequence[int]) -> tuple[list[Sample], list[ItemError]]:
        """The readable samples of ``indices`` and an error for each one that is not."""
        good: list[Sample] = []
        bad: list[ItemError] = []
        for i in indices:
            try:
                good.append(self.read(i))
            except ItemError as exc:
                bad.append(exc)
        return good, bad

    def _read_tar(self, entry: _TarEntry) -> Sample:
        name = f"{entry.path.name}:{entry.key}"
        parts: dict[str, bytes] = {}
        with entry.path.open("rb") as handle:
            for ext, offset, size in entry.members:
                limit = self.max_image_bytes if ext.rsplit(".", 1)[-1] in IMAGE_EXTS else MAX_TEXT_BYTES
                if size > limit:
                    raise ItemError(name, f"member .{ext} of {size} bytes is over the {limit}-byte limit")
                handle.seek(offset)
                parts[ext] = handle.read(size)
        if "json" in parts and "txt" not in parts:
            return _from_record(name, entry.key, parts)
        return _from_laion(name, entry.key, parts)

    def _read_row(self, entry: _RowEntry) -> Sample:
        import pyarrow.parquet as pq

        name = f"{entry.path.name}:row {entry.row}"
        if self._table is None or self._table[0] != entry.path:
            self._table = (entry.path, pq.read_table(entry.path))
        table = self._table[1]
        for column in ("texts", "images"):
            if column not in table.column_names:
                raise ItemError(name, f"no {column!r} column (an OBELICS-style shard has texts and images)")
        texts = table.column("texts")[entry.row].as_py() or []
        images = table.column("images")[entry.row].as_py() or []
        meta: Any = table.column("meta")[entry.row].as_py() if "meta" in table.column_names else {}
        if isinstance(meta, str):
            try:
                meta = json.loads(meta)
            except ValueError:
                meta = {"raw": meta}
        return _from_obelics(name, str(entry.row), texts, images, meta if isinstance(meta, dict) else {})


def _from_record(name: str, key: str, parts: dict[str, bytes]) -> Sample:
    try:
        body = json.loads(parts["json"])
    except ValueError as exc:
        raise ItemError(name, f"unreadable .json ({exc})") from None
    if not isinstance(body, dict) or body.get("kind") not in KINDS:
        raise ItemError(name, f".json: kind must be one of {', '.join(KINDS)}")
    images: list[bytes] = []
    i = 0
    while True:
        found = [ext for ext in parts if ext.startswith(f"{i}.")]
        if not found:
            break
        if found[0].split(".", 1)[1] not in IMAGE_EXTS:
            raise ItemError(name, f"image {i}: unsupported format .{found[0].split('.', 1)[1]}")
        images.append(parts[found[0]])
        i += 1
    used = {"json", *(f"{i}.{ext}" for i, ext in enumerate(_ext_of(parts, n) for n in range(len(images))))}
    extra = sorted(set(parts) - used)
    if extra:
        # e.g. an image with no place in the sample (image 2 with no image 1), or a stray member
        raise ItemError(name, f"members outside the sample's layout: {', '.join('.' + e for e in extra)}")
    raw_meta = body.get("meta")
    meta: dict[str, Any] = raw_meta if isinstance(raw_meta, dict) else {}
    if body["kind"] == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ItemError(name, "a chat sample needs a non-empty messages list")
        return Sample(key, "chat", messages=messages, images=images, meta=meta)
    segments = body.get("segments")
    if not isinstance(segments, list) or not segments:
        raise ItemError(name, "a non-chat sample needs a non-empty segments list")
    return Sample(key, body["kind"], segments=segments, images=images, meta=meta)


def _ext_of(parts: dict[str, bytes], i: int) -> str:
    return next(ext for ext in parts if ext.startswith(f"{i}.")).split(".", 1)[1]


def _from_laion(name: str, key: str, parts: dict[str, bytes]) -> Sample:
    found = [ext for ext in parts if ext in IMAGE_EXTS]
    if "txt" not in parts:
        raise ItemError(name, "neither a .json record nor a caption (.txt)")
    if len(found) != 1:
        unsupported = [e for e in parts if e not in ("txt", "json")]
        reason = (
            f"unsupported image format .{unsupported[0]}" if unsupported else "a caption without an image"
        )
        raise ItemError(name, reason if not found else "more than one image for one caption")
    try:
        text = parts["txt"].decode("utf-8")
    except UnicodeDecodeError:
        raise ItemError(name, "the caption is not UTF-8") from None
    meta: dict[str, Any] = {}
    if "json" in parts:
        try:
            loaded = json.loads(parts["json"])
            meta = loaded if isinstance(loaded, dict) else {}
        except ValueError:
            meta = {}
    return Sample(
        key, "caption", segments=[{"image": 0}, {"text": text}], images=[parts[found[0]]], meta=meta
    )


def _from_obelics(name: str, key: str, texts: list[Any], images: list[Any], meta: dict[str, Any]) -> Sample:
    if len(texts) != len(images):
        raise ItemError(name, f"texts ({len(texts)}) and images ({len(images)}) differ in length")
    segments: list[dict[str, Any]] = []
    data: list[bytes] = []
    for i, (text, image) in enumerate(zip(texts, images, strict=True)):
        if isinstance(image, dict):
            image = image.get("bytes")
        if (text is None) == (image is None):
            raise ItemError(name, f"position {i}: exactly one of text and image must be set")
        if isinstance(image, str):
            raise ItemError(name, f"position {i}: an image URL, not image bytes (download the images first)")
        if image is not None:
            segments.append({"image": len(data)})
            data.append(bytes(image))
        else:
            segments.append({"text": str(text)})
    if not segments:
        raise ItemError(name, "an empty document")
    return Sample(key, "document", segments=segments, images=data, meta=meta)
