"""Where the repository and its data folders are, for services run from a checkout."""

from __future__ import annotations

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
