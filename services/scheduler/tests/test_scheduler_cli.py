from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from forge_scheduler.cli import app, parse_quota


def test_parse_quota_full_and_short_forms() -> None:
    full = parse_quota("H100=8:4:2")
    assert (full.gpu_type, full.guaranteed_gpus, full.borrow_limit, full.weight) == ("H100", 8, 4, 2.0)
    short = parse_quota("A100=2")
    assert (short.guaranteed_gpus, short.borrow_limit, short.weight) == (2, 0, 1.0)


@pytest.mark.parametrize("bad", ["H100", "=8", "H100=x", "H100=1:2:3:4"])
def test_parse_quota_rejects_malformed(bad: str) -> None:
    with pytest.raises(typer.BadParameter):
        parse_quota(bad)


def test_unreachable_scheduler_is_one_clear_error() -> None:
    result = CliRunner().invoke(
        app, ["list", "--target", "127.0.0.1:1"], env={"FORGE_CLI_SCHEDULER_TOKEN": "t"}
    )
    assert result.exit_code == 1
    assert "UNAVAILABLE" in result.output
