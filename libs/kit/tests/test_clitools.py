"""``forge_kit.clitools``: expected failures in one line, progress only on a terminal."""

from __future__ import annotations

import asyncio
import io

import httpx
import pytest
import typer

from forge_kit import clitools
from forge_kit.testing.processes import free_port


def test_a_refused_http_connection_is_one_line_naming_the_url() -> None:
    url = f"http://127.0.0.1:{free_port()}/v1/models"
    with pytest.raises(httpx.ConnectError) as caught:
        httpx.get(url, timeout=5)
    message = clitools.describe_error(caught.value)
    assert message is not None and url in message and "is it running?" in message
    assert "\n" not in message


def test_unexpected_errors_are_not_swallowed() -> None:
    assert clitools.describe_error(ValueError("a bug")) is None
    assert clitools.describe_error(TimeoutError()) == "timed out"

    async def boom() -> None:
        raise KeyError("bug")

    with pytest.raises(KeyError):
        clitools.run_rpc(boom())

    async def refused() -> None:
        await asyncio.open_connection("127.0.0.1", free_port())

    with pytest.raises(typer.Exit):
        clitools.run_rpc(refused())


def test_progress_draws_only_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for stream, quiet, drawn in (
        (io.StringIO(), False, False),
        (Terminal(), True, False),
        (Terminal(), False, True),
    ):
        monkeypatch.setattr("sys.stderr", stream)
        with clitools.stages(2, quiet=quiet) as start:
            start("first part")
            start("second part")
        assert ("second part" in stream.getvalue() or "done" in stream.getvalue()) is drawn
