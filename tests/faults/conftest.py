"""Fixtures of the fault suite; the harness lives in ``fault_platform.py``."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fault_platform import Platform, start_platform, stop_platform


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A long scenario is a full one too, so ``make test`` (``not faults_full``) never runs it."""
    for item in items:
        if item.get_closest_marker("faults_long") and not item.get_closest_marker("faults_full"):
            item.add_marker(pytest.mark.faults_full)


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    started = start_platform(tmp_path_factory.mktemp("faults"))
    yield started
    stop_platform(started)
