"""The fault harness itself, against real sockets, processes, mounts and namespaces: the proxy's
latency, loss, bandwidth, resets and one-way and two-way partitions; SIGSTOP; a full tmpfs; a
skewed wall clock; a veth link taken down and rate-limited; a YAML scenario played on a link."""

from __future__ import annotations

import asyncio
import itertools
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from faultkit.host import NetNamespace, SizedMount, faketime_library, paused, skewed_clock_env
from faultkit.scenario import Scenario, Targets, load_scenarios, run_timeline

from forge_kit.testing.fault_proxy import FaultProxy, LinkFaults
from forge_kit.testing.requires import missing

pytestmark = [pytest.mark.faults_full, pytest.mark.timeout(120)]


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


@pytest.fixture
async def link() -> AsyncIterator[FaultProxy]:
    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    proxy = FaultProxy(("127.0.0.1", port), name="echo").start()
    try:
        yield proxy
    finally:
        proxy.stop()
        server.close()


async def round_trip(proxy: FaultProxy, payload: bytes, timeout_s: float = 10) -> float:
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    started = time.monotonic()
    try:
        writer.write(payload)
        await writer.drain()
        got = await asyncio.wait_for(reader.readexactly(len(payload)), timeout_s)
        assert got == payload
        return time.monotonic() - started
    finally:
        writer.close()


@pytest.mark.asyncio
async def test_latency_loss_and_bandwidth_shape_the_link(link: FaultProxy) -> None:
    assert await round_trip(link, b"x" * 100) < 0.15
    link.configure(latency_s=0.3)
    assert await round_trip(link, b"x" * 100) >= 0.6  # each way
    link.configure(latency_s=0.0, loss=0.5, rto_s=0.05)
    for _ in range(6):
        await round_trip(link, b"y" * 1000)  # lost chunks arrive late, intact and in order
    assert link.stats.delayed_chunks > 0
    link.heal()
    assert await round_trip(link, b"z" * 200_000) < 0.5
    link.configure(bandwidth_bps=200_000)
    assert await round_trip(link, b"z" * 200_000) >= 0.9  # 1 s each way, the two pipelined


@pytest.mark.asyncio
async def test_partitions_one_way_and_both_then_heal(link: FaultProxy) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
    link.partition("down")  # the service hears the client, the client hears nothing
    writer.write(b"ping")
    await writer.drain()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reader.readexactly(4), 1.0)
    assert link.stats.bytes_up == 4 and link.stats.bytes_down == 0
    link.heal()
    assert await asyncio.wait_for(reader.readexactly(4), 5) == b"ping"  # held, not lost
    link.partition("both")
    with pytest.raises(TimeoutError):
        await round_trip(link, b"new", timeout_s=1.0)
    link.heal(reset=True)
    with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
        await asyncio.wait_for(reader.readexactly(1), 5)  # the held connection was cut
    writer.close()
    assert await round_trip(link, b"after") < 2


@pytest.mark.asyncio
async def test_what_a_sender_sent_before_dying_behind_a_partition_never_arrives() -> None:
    received: list[bytes] = []

    async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.append(await reader.read())
        writer.close()

    server = await asyncio.start_server(sink, "127.0.0.1", 0)
    proxy = FaultProxy(("127.0.0.1", server.sockets[0].getsockname()[1]), name="sink").start()
    try:
        _, alive = await asyncio.open_connection("127.0.0.1", proxy.port)
        _, dying = await asyncio.open_connection("127.0.0.1", proxy.port)
        await asyncio.sleep(0.3)  # both reach the service before the partition
        proxy.partition("up")
        alive.write(b"retransmitted")
        dying.write(b"never-arrives")
        await asyncio.gather(alive.drain(), dying.drain())
        dying.transport.abort()  # the sender dies while cut off
        await asyncio.sleep(0.5)
        proxy.heal()
        alive.write_eof()
        deadline = time.monotonic() + 5
        while len(received) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert sorted(received) == [b"", b"retransmitted"]
        alive.close()
    finally:
        proxy.stop()
        server.close()


@pytest.mark.asyncio
async def test_resets_refuse_connections(link: FaultProxy) -> None:
    link.configure(reset=1.0)
    reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
    with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
        writer.write(b"x")
        await writer.drain()
        await asyncio.wait_for(reader.readexactly(1), 5)
    writer.close()
    assert link.stats.resets == 1
    with pytest.raises(ValueError):
        LinkFaults(loss=1.0)
    with pytest.raises(ValueError):
        link.configure(blackhole="sideways")


@pytest.mark.asyncio
async def test_a_yaml_scenario_plays_on_its_link(link: FaultProxy, tmp_path: Path) -> None:
    scenario = Scenario.model_validate(
        {
            "description": "a short partition",
            "faults": [{"fault": "partition", "target": "echo", "at_s": 0.2, "for_s": 1.0}],
        }
    )
    playing = asyncio.create_task(run_timeline(scenario, Targets(links={"echo": link})))
    await asyncio.sleep(0.5)
    assert link.faults.blackhole == {"up", "down"}
    (applied,) = await playing
    assert link.faults.blackhole == frozenset()
    assert 0.9 <= applied.healed_s - applied.began_s <= 2.0  # type: ignore[operator]
    with pytest.raises(KeyError, match="no such target"):
        await run_timeline(scenario, Targets(links={}))
    (tmp_path / "bad.yaml").write_text(
        "x:\n  description: d\n  faults: [{fault: latency, target: a, at_s: 0, for_s: 1}]\n"
    )
    with pytest.raises(ValueError, match="latency_s"):
        load_scenarios(tmp_path / "bad.yaml")
    assert "broker_partition" in load_scenarios()  # the suite's own file parses


def test_sigstop_pauses_a_process() -> None:
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nwhile True:\n print(time.monotonic(), flush=True)\n time.sleep(0.05)",
        ],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert child.stdout is not None
        first = float(child.stdout.readline())
        with paused(child.pid):
            time.sleep(1.2)
        lines = [first, *(float(child.stdout.readline()) for _ in range(5))]
        gaps = [b - a for a, b in itertools.pairwise(lines)]
        assert max(gaps) >= 1.0  # the stall shows in its own clock
    finally:
        child.kill()
        child.wait()


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[SizedMount]:
    if why := SizedMount.available():
        missing(why)
    sized = SizedMount(tmp_path / "disk", 4 << 20).mount()
    yield sized
    sized.unmount()


def test_a_sized_mount_fills_and_drains(mount: SizedMount) -> None:
    assert mount.fill() > 3 << 20
    with pytest.raises(OSError, match="No space left"):
        (mount.path / "more").write_bytes(b"x" * 8192)
    mount.drain()
    (mount.path / "more").write_bytes(b"x" * 8192)
    mount.resize(8 << 20)
    assert mount.free_bytes() > 7 << 20


def test_libfaketime_moves_the_wall_clock_only() -> None:
    if faketime_library() is None:
        missing("libfaketime is not installed (apt-get install faketime; `make test` does as root)")
    code = "import time; print(time.time(), time.monotonic())"
    true_wall, true_mono = time.time(), time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", code], env=skewed_clock_env(600), capture_output=True, text=True, check=True
    )
    wall, mono = (float(v) for v in done.stdout.split())
    assert 590 < wall - true_wall < 630
    assert abs(mono - true_mono) < 30


@pytest.fixture
def namespace() -> Iterator[NetNamespace]:
    if why := NetNamespace.available():
        missing(why)
    made = NetNamespace("kit", 7).create()
    yield made
    made.delete()


def test_a_veth_link_partitions_and_rate_limits(namespace: NetNamespace) -> None:
    port = 8765
    sink = (
        "import socket\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
        f"s.bind(('{namespace.ns_ip}',{port}));s.listen()\n"
        "while True:\n c,_=s.accept()\n while c.recv(65536): pass\n c.close()\n"
    )
    server = namespace.popen([sys.executable, "-c", sink])
    try:

        def send(size: int, timeout_s: float) -> float:
            started = time.monotonic()
            with socket.create_connection((namespace.ns_ip, port), timeout=timeout_s) as conn:
                conn.sendall(b"x" * size)
                conn.shutdown(socket.SHUT_WR)
                assert conn.recv(1) == b""  # the server closes once it has read everything
            return time.monotonic() - started

        deadline = time.monotonic() + 10
        while True:
            try:
                send(10, 1)
                break
            except OSError:
                assert time.monotonic() < deadline, "the server in the namespace never answered"
                time.sleep(0.1)
        namespace.partition()
        with pytest.raises(OSError):
            send(10, 1.0)
        namespace.heal()
        send(10, 5)
        namespace.limit(800_000)  # 100 kB/s
        assert send(300_000, 20) >= 1.5
    finally:
        server.kill()
        server.wait()
