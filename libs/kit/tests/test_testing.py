"""The testing helpers: ports, the pytest plugin, the real Temporal dev server."""

from __future__ import annotations

import socket
import time

import pytest

from forge_kit.testing import TemporalDevServer, eventually, free_port, wait_for_port
from forge_kit.testing.processes import port_open


def test_free_port_is_bindable() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


@pytest.mark.integration
def test_wait_for_port_times_out_on_a_closed_port() -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=str(port := free_port())):
        wait_for_port(port, timeout_s=0.2)
    assert time.monotonic() - started < 2


async def test_eventually_returns_the_first_truthy_value_of_a_sync_or_async_probe() -> None:
    calls: list[int] = []

    def sync_probe() -> list[int]:
        calls.append(1)
        return calls if len(calls) == 3 else []

    async def async_probe() -> str:
        return "ready"

    assert await eventually(sync_probe, interval_s=0) == [1, 1, 1]
    assert await eventually(async_probe) == "ready"


async def test_eventually_fails_loudly_with_what_it_waited_for() -> None:
    with pytest.raises(AssertionError, match=r"not within 0.1s: the door to open \(last: 0\)"):
        await eventually(lambda: 0, timeout_s=0.1, what="the door to open")


def test_plugin_is_registered_through_the_entry_point(pytestconfig: pytest.Config) -> None:
    plugin = pytestconfig.pluginmanager.get_plugin("forge_kit")
    assert plugin is not None
    assert plugin.__name__ == "forge_kit.testing.plugin"
    markers = pytestconfig.getini("markers")
    assert any(m.startswith("integration:") for m in markers)


def test_unused_port_fixture(unused_port: int) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", unused_port))


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_temporal_dev_server_starts_and_stops() -> None:
    server = TemporalDevServer().start(timeout_s=45)
    try:
        assert port_open(server.port)
        assert server.target == f"127.0.0.1:{server.port}"
    finally:
        server.stop()
    assert server.proc is None
    assert not port_open(server.port)
