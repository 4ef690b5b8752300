"""An in-process gRPC server for API tests: the service's servicer behind the real kit server
(health, reflection, auth, deadlines, error mapping) on a free port."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import grpc

from forge_kit.grpckit import Authenticator, GrpcServer, serve


@asynccontextmanager
async def grpc_test_server(
    add: Callable[[Any, grpc.aio.Server], None],
    servicer: Any,
    service_name: str,
    *,
    token: str | None,
    default_deadline_s: float = 5.0,
    service: str = "test",
    authenticators: Sequence[Authenticator] = (),
) -> AsyncIterator[GrpcServer]:
    """``add`` is the generated ``add_XServicer_to_server``; ``service_name`` its full name."""
    started = await serve(
        service=service,
        register=[lambda server: add(servicer, server)],
        service_names=[service_name],
        host="127.0.0.1",
        port=0,
        token=token,
        default_deadline_s=default_deadline_s,
        authenticators=authenticators,
    )
    try:
        yield started
    finally:
        await started.stop(0)
