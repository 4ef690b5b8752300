"""HTTP side of a service: FastAPI app with ``/healthz``, ``/readyz``, ``/metrics`` and error mapping.

Domain errors become 400/404/409/422/429 JSON bodies naming the field; nothing unexpected leaks
as a stack trace. ``require_token`` is the bearer-token dependency for HTTP APIs.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from forge_kit import errors
from forge_kit.limits import DEFAULT_MAX_BODY_BYTES, BodySizeLimit

ReadinessCheck = Callable[[], Awaitable[bool]]


def _error(
    status: int, code: str, message: str, field: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    body: dict[str, object] = {"error": {"code": code, "message": message}}
    if field is not None:
        body["error"]["field"] = field  # type: ignore[index]
    return JSONResponse(body, status_code=status, headers=headers)


NO_OTEL = {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}


def _query_names(dependant: Any) -> set[str]:
    names = {param.alias for param in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _query_names(sub)
    return names


async def reject_unknown_query(request: Request) -> None:
    """A route dependency: a query parameter the route does not declare is refused (400, naming
    it) rather than ignored, so a misspelt ``limit`` or ``after`` never pages with the default."""
    dependant = getattr(request.scope.get("route"), "dependant", None)
    if dependant is None:
        return
    unknown = sorted(set(request.query_params) - _query_names(dependant))
    if unknown:
        shown = ", ".join(repr(name[:64]) for name in unknown[:5])
        raise errors.ValidationError("query", f"unknown parameter(s): {shown}")


def make_app(
    service: str, readiness: Mapping[str, ReadinessCheck] | None = None, **kwargs: object
) -> FastAPI:
    """A FastAPI app with the probes every Forge HTTP server has.

    ``readiness`` maps a dependency name to a check; ``/readyz`` is 200 only when all pass.
    """
    # Forge's metrics are Prometheus (``/metrics``) and its logs structlog; FastAPI's own
    # OpenTelemetry hooks, with no provider configured, would still look the global providers
    # up on every request (about 5 % of the preference service's event-loop samples under
    # load, py-spy).
    kwargs.setdefault("telemetry", NO_OTEL)
    app = FastAPI(title=f"forge-{service}", **kwargs)  # type: ignore[arg-type]
    checks = readiness or {}

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, str]:
        return {"status": "ok", "service": service}

    async def run_check(check: ReadinessCheck) -> bool:
        try:
            return bool(await check())
        except Exception:  # noqa: BLE001 - a failing dependency means not ready, not a 500
            return False

    @app.get("/readyz", include_in_schema=False)
    async def readyz() -> Response:
        results = {name: await run_check(check) for name, check in checks.items()}
        status = 200 if all(results.values()) else 503
        return JSONResponse({"ready": status == 200, "checks": results}, status_code=status)

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return PlainTextResponse(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(errors.ValidationError)
    async def _invalid(_: Request, exc: errors.ValidationError) -> JSONResponse:
        return _error(400, "invalid_argument", exc.message, field=exc.field)

    @app.exception_handler(RequestValidationError)
    async def _unprocessable(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        field = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return _error(422, "invalid_argument", f"{field}: {first.get('msg')}", field=field)

    @app.exception_handler(errors.NotFoundError)
    async def _missing(_: Request, exc: errors.NotFoundError) -> JSONResponse:
        return _error(404, "not_found", exc.message)

    @app.exception_handler(errors.AlreadyExistsError)
    async def _exists(_: Request, exc: errors.AlreadyExistsError) -> JSONResponse:
        return _error(409, "already_exists", exc.message)

    @app.exception_handler(errors.ConflictError)
    async def _conflict(_: Request, exc: errors.ConflictError) -> JSONResponse:
        return _error(409, "failed_precondition", exc.message)

    @app.exception_handler(errors.OverloadedError)
    async def _overloaded(_: Request, exc: errors.OverloadedError) -> JSONResponse:
        # Round up: a client that waits less than asked for is refused again.
        retry = str(max(1, math.ceil(exc.retry_after_s)))
        return _error(429, "resource_exhausted", exc.message, headers={"Retry-After": retry})

    @app.exception_handler(errors.UnavailableError)
    async def _unavailable(_: Request, exc: errors.UnavailableError) -> JSONResponse:
        retry = str(max(1, math.ceil(exc.retry_after_s)))
        return _error(503, "unavailable", exc.message, headers={"Retry-After": retry})

    @app.exception_handler(errors.UnauthenticatedError)
    async def _unauthenticated(_: Request, exc: errors.UnauthenticatedError) -> JSONResponse:
        return _error(401, "unauthenticated", exc.message, headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(errors.PermissionDeniedError)
    async def _denied(_: Request, exc: errors.PermissionDeniedError) -> JSONResponse:
        return _error(403, "permission_denied", exc.message)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        if errors.storage_full(exc):
            return _error(507, "insufficient_storage", errors.STORAGE_FULL_MESSAGE)
        return _error(500, "internal", "internal error")

    return app


def require_token(token: str | None) -> Callable[[Request], Awaitable[None]]:
    """A FastAPI dependency that rejects requests without ``Authorization: Bearer <token>``."""

    async def check(request: Request) -> None:
        if token is None:
            return
        header = request.headers.get("authorization", "")
        if not secrets.compare_digest(header.encode(), f"Bearer {token}".encode()):
            raise errors.UnauthenticatedError("missing or invalid bearer token")

    return check


class HttpServer:
    """uvicorn running inside the service's event loop; ``port`` is known once started. Request
    bodies over ``max_body_bytes`` are answered 413 (:class:`forge_kit.limits.BodySizeLimit`)."""

    def __init__(
        self, app: FastAPI, host: str, port: int, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    ) -> None:
        self._config = uvicorn.Config(
            BodySizeLimit(app, max_body_bytes),
            host=host,
            port=port,
            log_config=None,
            access_log=False,
            lifespan="off",
        )
        self._server = uvicorn.Server(self._config)
        self._task: asyncio.Task[None] | None = None
        self.port = port

    async def start(self) -> None:
        # The service's runtime owns SIGTERM/SIGINT; uvicorn must not take them over.
        self._server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("HTTP server exited during start-up")
            await asyncio.sleep(0.01)
        sockets = [s for server in self._server.servers for s in server.sockets]
        if sockets:
            self.port = int(sockets[0].getsockname()[1])

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await self._task
