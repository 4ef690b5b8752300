"""Faults of the host, not the link: a paused process, a full disk, a skewed clock, a network
namespace joined by a veth pair (for partitions at the IP level and ``tc tbf`` bandwidth).

Each needs what this machine gives root: ``mount -t tmpfs``, ``ip netns``, ``tc``; ``available()``
says whether it can be had here so a test can skip saying why. Clock skew uses Debian's
``libfaketime`` (``LD_PRELOAD``): a time namespace (``unshare --time``) offsets only the
monotonic and boot clocks, never the wall clock, so it cannot move a service's idea of "now".
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

FAKETIME_GLOBS = ("/usr/lib/*/faketime/libfaketimeMT.so.1", "/usr/lib/faketime/libfaketimeMT.so.1")


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")


# Process pause (a GC-like stall).


def pause(pid: int) -> None:
    """Stop the process group ``pid`` leads (SIGSTOP: it cannot catch or ignore it)."""
    os.killpg(pid, signal.SIGSTOP)


def resume(pid: int) -> None:
    os.killpg(pid, signal.SIGCONT)


@contextlib.contextmanager
def paused(pid: int) -> Iterator[None]:
    pause(pid)
    try:
        yield
    finally:
        resume(pid)


# A size-limited mount (a disk that fills).


class SizedMount:
    """A tmpfs of ``size_bytes`` mounted on ``path``: a service's data folder whose disk fills.

    :meth:`fill` takes all the space left with a file of its own (another tenant of the disk),
    :meth:`drain` gives it back; :meth:`resize` changes the size in place (contents kept).
    """

    def __init__(self, path: Path, size_bytes: int) -> None:
        self.path = path
        self.size_bytes = size_bytes
        self._filler = path / ".faults-filler"
        self.mounted = False

    @staticmethod
    def available() -> str | None:
        """None where tmpfs can be mounted here, else why not."""
        if os.geteuid() != 0:
            return "mounting a tmpfs needs root"
        if shutil.which("mount") is None:
            return "no mount(8)"
        return None

    def mount(self) -> SizedMount:
        self.path.mkdir(parents=True, exist_ok=True)
        _run("mount", "-t", "tmpfs", "-o", f"size={self.size_bytes},mode=0755", "tmpfs", str(self.path))
        self.mounted = True
        return self

    def resize(self, size_bytes: int) -> None:
        _run("mount", "-o", f"remount,size={size_bytes}", str(self.path))
        self.size_bytes = size_bytes

    def free_bytes(self) -> int:
        stat = os.statvfs(self.path)
        return stat.f_bavail * stat.f_frsize

    def fill(self, leave_bytes: int = 0) -> int:
        """Write a file until the disk is full, then give ``leave_bytes`` back (a disk that fills
        partway through the next large write); returns the bytes it took."""
        written = 0
        fd = os.open(self._filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for size in (1 << 20, 1 << 12, 1):
                block = b"\0" * size
                while True:
                    try:
                        written += os.write(fd, block)
                    except OSError as exc:
                        if exc.errno != errno.ENOSPC:
                            raise
                        break
            if leave_bytes:
                written = max(0, written - leave_bytes)
                os.ftruncate(fd, written)
        finally:
            os.close(fd)
        return written

    def drain(self) -> None:
        self._filler.unlink(missing_ok=True)

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True, timeout=30)
            self.mounted = False


# Clock skew.


def faketime_library() -> str | None:
    for pattern in FAKETIME_GLOBS:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def skewed_clock_env(offset_s: float) -> dict[str, str]:
    """Environment that starts a process with its wall clock ``offset_s`` ahead (negative:
    behind). Only the wall clock moves (``CLOCK_REALTIME``): monotonic clocks stay true, as when
    a host's clock is set wrong. Raises where libfaketime is missing (``apt-get install faketime``)."""
    library = faketime_library()
    if library is None:
        raise RuntimeError("libfaketime is not installed (Debian package faketime)")
    return {
        "LD_PRELOAD": library,
        "FAKETIME": f"{offset_s:+.0f}",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "FAKETIME_DONT_RESET": "1",  # child processes keep the parent's offset
    }


# Network namespaces.


class NetNamespace:
    """A network namespace joined to the host by a veth pair: host ``10.213.N.1``, namespace
    ``10.213.N.2`` (``N`` from 1 to 250). Traffic between them never leaves the machine.

    :meth:`partition` takes the namespace's end of the link down (both ways), :meth:`heal`
    brings it up, :meth:`limit` caps the host → namespace rate with ``tc tbf``. :meth:`popen`
    starts a command inside the namespace. An ``unreachable`` route for the subnet (a higher
    metric than the link's) keeps its packets on this machine whatever the link's state: without
    it, a host whose end of the link is down would send them to its default gateway."""

    def __init__(self, name: str, index: int) -> None:
        if not (1 <= index <= 250) or not name.isidentifier() or len(name) > 10:
            raise ValueError("a short identifier name and an index in 1..250")
        self.name = f"fk{name}"
        self.host_if = f"{self.name}h"
        self.ns_if = f"{self.name}n"
        self.host_ip = f"10.213.{index}.1"
        self.ns_ip = f"10.213.{index}.2"
        self.subnet = f"10.213.{index}.0/24"

    @staticmethod
    def available() -> str | None:
        if os.geteuid() != 0:
            return "network namespaces need root"
        if shutil.which("ip") is None or shutil.which("tc") is None:
            return "iproute2 (ip, tc) is missing"
        return None

    def create(self) -> NetNamespace:
        self.delete()
        _run("ip", "netns", "add", self.name)
        _run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
        _run("ip", "link", "set", self.ns_if, "netns", self.name)
        _run("ip", "addr", "add", f"{self.host_ip}/24", "dev", self.host_if)
        _run("ip", "link", "set", self.host_if, "up")
        _run("ip", "route", "add", "unreachable", self.subnet, "metric", "4000")
        self._in("ip", "addr", "add", f"{self.ns_ip}/24", "dev", self.ns_if)
        self._in("ip", "link", "set", self.ns_if, "up")
        self._in("ip", "link", "set", "lo", "up")
        return self

    def _in(self, *argv: str) -> None:
        _run("ip", "netns", "exec", self.name, *argv)

    def popen(self, argv: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
        return subprocess.Popen(["ip", "netns", "exec", self.name, *argv], **kwargs)  # type: ignore[call-overload]

    def partition(self) -> None:
        self._in("ip", "link", "set", self.ns_if, "down")

    def heal(self) -> None:
        self._in("ip", "link", "set", self.ns_if, "up")
        with contextlib.suppress(RuntimeError):
            _run("tc", "qdisc", "del", "dev", self.host_if, "root")

    def limit(self, rate_bits: int) -> None:
        """Cap the host → namespace direction at ``rate_bits`` per second (token bucket filter)."""
        _run(
            "tc", "qdisc", "replace", "dev", self.host_if, "root", "tbf",
            "rate", f"{rate_bits}bit", "burst", "16kb", "latency", "400ms",
        )  # fmt: skip

    def delete(self) -> None:
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, timeout=30)
        subprocess.run(
            ["ip", "route", "del", "unreachable", self.subnet, "metric", "4000"],
            capture_output=True,
            timeout=30,
        )
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)
