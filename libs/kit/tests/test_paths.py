"""The data folder: FORGE_DATA_DIR, else var/datasets in the checkout; relative settings inside it."""

from __future__ import annotations

from pathlib import Path

import pytest

from forge_kit.paths import data_dir, data_path, find_repo_root, resolve_data_path

REPO = Path(__file__).resolve().parents[3]


def test_the_repository_root_is_found_from_inside_it() -> None:
    assert find_repo_root(Path(__file__).resolve().parent) == REPO
    assert find_repo_root(Path("/")) is None


def test_the_data_folder_is_the_setting_else_var_data_of_the_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FORGE_DATA_DIR", str(tmp_path / "d"))
    assert data_dir() == tmp_path / "d"
    assert data_path("benchmarks", "gsm8k") == tmp_path / "d" / "benchmarks" / "gsm8k"
    monkeypatch.delenv("FORGE_DATA_DIR")
    monkeypatch.chdir(tmp_path)  # outside any checkout: this package's checkout
    assert data_dir() == REPO / "var" / "datasets"


def test_relative_settings_resolve_inside_the_data_folder_absolute_ones_as_they_are(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FORGE_DATA_DIR", str(tmp_path))
    assert resolve_data_path("beir/scifact") == tmp_path / "beir" / "scifact"
    assert resolve_data_path("/elsewhere/x.txt") == Path("/elsewhere/x.txt")
