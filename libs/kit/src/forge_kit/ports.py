"""A TCP port for a process this one starts (a server, a process group's rendezvous) to listen on."""

from __future__ import annotations

import socket


def free_port(host: str = "") -> int:
    """A TCP port nothing listens on now (the kernel's pick) on ``host``, by default on every
    interface, held back from the kernel's later picks for about a minute.

    Between this call and the child's bind, any process on the machine that binds port 0 (a
    server, Temporal's dev server choosing its internal ports, another caller of this function)
    could be handed the same port: the kernel picks ephemeral ports at random and reuses a freed
    one at once. So the port is left with a connection in ``TIME_WAIT`` (the listening side
    closes first), as Temporal's own ``GetFreePort`` does: while one lies there, the kernel gives
    the port to no ``bind(0)``, yet a server that sets ``SO_REUSEADDR`` (gRPC, uvicorn, Go, Rust,
    torch's ``TCPStore``) binds it at once. A child that still cannot bind fails its start,
    which its starter reports."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        # The connection's TIME_WAIT end inherits this: without it even SO_REUSEADDR binds fail.
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, 0))
        listener.listen(1)
        port = int(listener.getsockname()[1])
        with socket.create_connection(("127.0.0.1" if host in ("", "0.0.0.0") else host, port)) as client:
            accepted, _ = listener.accept()
            accepted.close()  # first: TIME_WAIT lands on the port's side of the connection
            client.recv(1)  # the close has reached the client
    return port
