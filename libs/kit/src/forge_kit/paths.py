"""Where the repository and the data folder are, for services run from a checkout; private
folders and files for the state services keep."""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR_ENV = "FORGE_DATA_DIR"


def find_repo_root(start: Path) -> Path | None:
    """The nearest folder above ``start`` holding both ``services/`` and ``libs/``."""
    for folder in [start, *start.parents]:
        if (folder / "services").is_dir() and (folder / "libs").is_dir():
            return folder
    return None


def data_dir() -> Path:
    """The data folder (``forge data fetch`` fills it): ``$FORGE_DATA_DIR`` when set, else
    ``var/datasets`` in the checkout of the working directory, else of this package, else under
    the working directory. (Services keep their own state apart, in ``var/data``.)"""
    setting = os.environ.get(DATA_DIR_ENV, "").strip()
    if setting:
        return Path(setting).expanduser().resolve()
    root = find_repo_root(Path.cwd()) or find_repo_root(Path(__file__).resolve().parent) or Path.cwd()
    return (root / "var" / "datasets").resolve()


def data_path(*parts: str) -> Path:
    """A path inside the data folder, e.g. ``data_path("benchmarks")``."""
    return data_dir().joinpath(*parts)


def resolve_data_path(setting: str | Path) -> Path:
    """A data setting as a path: an absolute one as is, a relative one (``benchmarks``,
    ``corpora/tinyshakespeare/input.txt``) inside the data folder."""
    path = Path(setting).expanduser()
    return path if path.is_absolute() else data_dir() / path


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
