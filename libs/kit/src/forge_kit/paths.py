"""Where the repository and the data folder are, for services run from a checkout."""

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
    ``var/data`` in the checkout of the working directory, else of this package, else under the
    working directory."""
    setting = os.environ.get(DATA_DIR_ENV, "").strip()
    if setting:
        return Path(setting).expanduser().resolve()
    root = find_repo_root(Path.cwd()) or find_repo_root(Path(__file__).resolve().parent) or Path.cwd()
    return (root / "var" / "data").resolve()


def data_path(*parts: str) -> Path:
    """A path inside the data folder, e.g. ``data_path("benchmarks")``."""
    return data_dir().joinpath(*parts)


def resolve_data_path(setting: str | Path) -> Path:
    """A data setting as a path: an absolute one as is, a relative one (``benchmarks``,
    ``corpora/tinyshakespeare/input.txt``) inside the data folder."""
    path = Path(setting).expanduser()
    return path if path.is_absolute() else data_dir() / path
