"""A TCP port for a process this one starts (a server, a process group's rendezvous) to listen on."""

from __future__ import annotations

import socket


def free_port(host: str = "") -> int:
    """A TCP port nothing listens on now (the kernel's pick) on ``host``, by default on every
    interface. Another process may take it before the caller's child binds it; a child that
    cannot bind fails its start, which its starter reports."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
