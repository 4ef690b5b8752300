"""Where the repository and its data folders are, for services run from a checkout; private
folders and files for the state services keep there."""

from __future__ import annotations

import os
from pathlib import Path


def find_repo_root(start: Path) -> Path | None:
    """The nearest folder above ``start`` holding both ``services/`` and ``libs/``."""
    for folder in [start, *start.parents]:
        if (folder / "services").is_dir() and (folder / "libs").is_dir():
            return folder
    return None


def resolve_data_path(setting: str) -> Path:
    """An absolute setting as is; a relative one (such as ``../shared/data/...``) against the
    working directory (the platform runs services from the repository root), else against the
    repository this package lives in; the working directory's when neither holds it."""
    path = Path(setting).expanduser()
    if path.is_absolute():
        return path
    root = find_repo_root(Path(__file__).resolve().parent)
    for base in [Path.cwd(), *([root] if root else [])]:
        if (base / path).is_dir():
            return (base / path).resolve()
    return (Path.cwd() / path).resolve()


def private_dir(path: str | os.PathLike[str], *, tighten: bool = True) -> Path:
    """``path`` as a directory only its owner can enter (0700), with any missing parents made the
    same way. For state that holds credentials, databases, audit trails or logs. An existing
    folder is tightened (``tighten``) only when this user owns it and it is not a shared
    sticky folder such as ``/tmp``; existing parents are left alone."""
    folder = Path(path)
    missing = [p for p in [folder, *folder.parents] if not p.exists()]
    for parent in reversed(missing):
        parent.mkdir(mode=0o700, exist_ok=True)
        parent.chmod(0o700)  # mkdir's mode is masked by the umask, which may be looser
    info = folder.stat()
    if tighten and info.st_mode & 0o077 and info.st_uid == os.geteuid() and not info.st_mode & 0o1000:
        folder.chmod(0o700)
    return folder


def private_file(path: str | os.PathLike[str]) -> Path:
    """``path`` as a file only its owner can read or write (0600), created empty if missing (its
    missing folders 0700). SQLite's ``-wal``/``-shm`` files take their database file's mode."""
    file = Path(path)
    private_dir(file.parent, tighten=False)
    os.close(os.open(file, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600))
    if file.stat().st_mode & 0o077:
        file.chmod(0o600)
    return file
