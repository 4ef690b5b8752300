"""A test whose program is absent skips on a developer's machine and fails in CI."""

from __future__ import annotations

import pytest

from forge_kit.testing.requires import missing


def test_missing_skips_outside_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no promtool"):
        missing("no promtool")


def test_missing_fails_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="no promtool — required in CI"):
        missing("no promtool")
