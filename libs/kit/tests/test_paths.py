"""Data folders named relative to the repository resolve from any working directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from forge_kit.paths import find_repo_root, resolve_data_path

REPO = Path(__file__).resolve().parents[3]


def test_the_repository_root_is_found_from_inside_it() -> None:
    assert find_repo_root(Path(__file__).resolve().parent) == REPO
    assert find_repo_root(Path("/")) is None


def test_relative_paths_resolve_against_the_working_directory_then_the_repository(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert resolve_data_path(str(tmp_path)) == tmp_path
    (tmp_path / "data" / "set").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_data_path("data/set") == tmp_path / "data" / "set"
    # Not under the working directory but in the repository: the repository's.
    assert resolve_data_path("libs/kit") == REPO / "libs" / "kit"
    # Neither: the working directory's, for the caller's "missing" error to name.
    assert resolve_data_path("nowhere") == tmp_path / "nowhere"
