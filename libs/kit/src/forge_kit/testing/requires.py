"""What a test needs from the machine: skipped where it is absent, but never in CI."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def missing(why: str) -> NoReturn:
    """Skip the test because a program or privilege it drives is absent here (``why`` says which
    and how to get it); under CI (``CI=true``, set by ``.ci/run``, whose ``make install`` and
    ``make test`` install these as root) fail instead, so CI never passes by skipping."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{why} — required in CI", pytrace=False)
    pytest.skip(why)
