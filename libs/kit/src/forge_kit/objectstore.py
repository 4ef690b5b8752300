"""Object store for checkpoints, datasets and model files, through fsspec.

A local directory by default (``var/objects``); ``s3://bucket/prefix`` and friends by URL.
Writes that others may read while in progress go to a temporary name first and are moved into
place, so a reader sees the whole object or nothing.
"""

from __future__ import annotations

import posixpath
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

import fsspec
from fsspec.core import url_to_fs

#: Suffix of an object still being written by :meth:`ObjectStore.open_atomic`.
_TMP_SUFFIX = re.compile(r"\.tmp-[0-9a-f]{32}$")


class ObjectStore:
    """Paths are ``/``-separated keys relative to the store's root URL."""

    def __init__(self, root_url: str) -> None:
        fs, root = url_to_fs(root_url)
        self.fs: fsspec.AbstractFileSystem = fs
        self.root = root.rstrip("/")
        self.fs.makedirs(self.root, exist_ok=True)

    def path(self, key: str) -> str:
        """The backend path of ``key``; rejects keys that escape the root."""
        clean = posixpath.normpath(key.lstrip("/"))
        if clean in (".", "..") or clean.startswith("../") or "\x00" in clean:
            raise ValueError(f"invalid object key: {key!r}")
        return f"{self.root}/{clean}"

    def url(self, key: str) -> str:
        """A URL another process can open with fsspec."""
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return f"{protocol}://{self.path(key)}" if protocol != "file" else self.path(key)

    @property
    def root_url(self) -> str:
        """The store's root as a URL another process can open (an absolute path when local)."""
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return self.root if protocol in ("file", "local") else f"{protocol}://{self.root}"

    def exists(self, key: str) -> bool:
        return bool(self.fs.exists(self.path(key)))

    def put_bytes(self, key: str, data: bytes) -> None:
        """Write ``data`` atomically (temporary name, then move)."""
        with self.open_atomic(key) as handle:
            handle.write(data)

    def get_bytes(self, key: str) -> bytes:
        with self.fs.open(self.path(key), "rb") as handle:
            return handle.read()  # type: ignore[no-any-return]

    def list(self, prefix: str = "") -> list[str]:
        """Keys under ``prefix``, recursively, sorted; objects still being written are left out."""
        base = self.path(prefix) if prefix else self.root
        if not self.fs.exists(base):
            return []
        found = self.fs.find(base)
        strip = len(self.root) + 1
        return sorted(str(p)[strip:] for p in found if not _TMP_SUFFIX.search(str(p)))

    def delete(self, key: str, recursive: bool = False) -> None:
        if self.exists(key):
            self.fs.rm(self.path(key), recursive=recursive)

    @contextmanager
    def open_atomic(self, key: str) -> Iterator[IO[bytes]]:
        """A binary file that appears under ``key`` only once closed without error."""
        final = self.path(key)
        self.fs.makedirs(posixpath.dirname(final), exist_ok=True)
        tmp = f"{final}.tmp-{uuid.uuid4().hex}"
        try:
            with self.fs.open(tmp, "wb") as handle:
                yield handle
            self.fs.mv(tmp, final)
        except BaseException:
            if self.fs.exists(tmp):
                self.fs.rm(tmp)
            raise
