"""The files the repository's checks read: what git tracks, plus untracked files it does not
ignore (a new file counts before it is committed), as repo-relative paths that exist."""

from __future__ import annotations

import subprocess
from pathlib import Path


def repo_files(root: Path, *patterns: str) -> list[str]:
    """Sorted paths under ``root`` matching the git pathspecs ``patterns`` (every file when none)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", *patterns],
        cwd=root,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    return sorted(path for path in set(listed) if (root / path).is_file())
