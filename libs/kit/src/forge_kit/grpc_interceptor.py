"""The server side of every Forge gRPC call: who called, until when, and what an error becomes.

:class:`ForgeServerInterceptor` (installed by :func:`forge_kit.grpckit.serve`), for every call:

1. checks the bearer token (health and reflection are open, as probes expect) and records who
   called as the :func:`current_principal`: the service token is the ``admin`` principal; a
   service may accept more tokens (e.g. the scheduler's team tokens) through ``authenticators``;
2. applies the default deadline when the caller set none, and records the effective deadline
   (:data:`current_deadline`) so that downstream calls made while handling inherit what is left;
3. maps domain errors (:mod:`forge_kit.errors`) to status codes — ``INVALID_ARGUMENT`` naming the
   field, ``NOT_FOUND``, ``RESOURCE_EXHAUSTED`` (also for a full disk), ``UNAVAILABLE`` for a dependency
   that did not answer — and anything else to
   ``INTERNAL`` without leaking internals;
4. counts and times the call in Prometheus, logs it, and audits the admin actions it asked for.

Handlers and callers use these through :mod:`forge_kit.grpckit`, which re-exports the public names.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import grpc
import structlog
from prometheus_client import Counter, Histogram

from forge_kit import audit, errors

log = structlog.get_logger(__name__)

GRPC_REQUESTS = Counter("forge_grpc_requests_total", "gRPC calls handled", ["service", "method", "code"])
GRPC_LATENCY = Histogram(
    "forge_grpc_request_seconds",
    "gRPC handling time",
    ["service", "method"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)

#: Methods callable without a token: probes and tooling must work before credentials exist.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

#: Absolute monotonic deadline (``time.monotonic()`` seconds) of the call being handled.
current_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "forge_current_deadline", default=None
)

#: Who made the call being handled (set by the interceptor after authentication).
_current_principal: contextvars.ContextVar[Principal | None] = contextvars.ContextVar(
    "forge_current_principal", default=None
)

#: Trailing-metadata key naming the invalid field of an ``INVALID_ARGUMENT`` error.
FIELD_METADATA_KEY = "forge-invalid-field"


@dataclass(frozen=True)
class Principal:
    """An authenticated caller: ``role`` is ``admin`` (the service token) or ``team`` (a token
    that acts for ``team`` only)."""

    name: str
    role: str
    team: str = ""

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"


#: The principal of the shared service token: operators, the CLI's admin commands, other services.
SERVICE_PRINCIPAL = Principal(name="service", role="admin")

#: Maps a presented bearer token to a principal, or None when it does not know the token; it may
#: be a coroutine function (e.g. one that asks the service that issued the token).
Authenticator = Callable[[str], Principal | Awaitable[Principal | None] | None]


def current_principal() -> Principal | None:
    """The caller of the gRPC call being handled; None outside a call or when auth is off."""
    return _current_principal.get()


_admin_actions: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "forge_admin_actions", default=None
)
"""Admin actions the call being handled asked for (a list shared with the handler's task, which
``asyncio.wait_for`` runs in a copy of the context): audited when the call ends."""


def require_admin(action: str) -> None:
    """Raise PermissionDeniedError unless the current caller is an admin (or auth is off).

    The call is audited (:mod:`forge_kit.audit`) when it ends, whether allowed or not.
    """
    pending = _admin_actions.get()
    if pending is not None:
        pending.append(action)
    principal = current_principal()
    if principal is not None and not principal.is_admin:
        raise errors.PermissionDeniedError(f"{action} needs an admin token; {principal.name} is not an admin")


def remaining_deadline() -> float | None:
    """Seconds left of the call being handled, or None outside a call."""
    deadline = current_deadline.get()
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _token_matches(header: str | bytes | None, token: str) -> bool:
    if header is None:
        return False
    presented = header if isinstance(header, bytes) else header.encode()
    return secrets.compare_digest(presented, f"Bearer {token}".encode())


def _bearer(header: str | bytes | None) -> str | None:
    if header is None:
        return None
    text = header.decode(errors="replace") if isinstance(header, bytes) else header
    scheme, _, value = text.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def _status_for(exc: BaseException) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    if isinstance(exc, errors.ValidationError):
        return grpc.StatusCode.INVALID_ARGUMENT, exc.message, ((FIELD_METADATA_KEY, exc.field),)
    if isinstance(exc, errors.NotFoundError):
        return grpc.StatusCode.NOT_FOUND, exc.message, ()
    if isinstance(exc, errors.AlreadyExistsError):
        return grpc.StatusCode.ALREADY_EXISTS, exc.message, ()
    if isinstance(exc, errors.ConflictError):
        return grpc.StatusCode.FAILED_PRECONDITION, exc.message, ()
    if isinstance(exc, errors.OverloadedError):
        retry = (("retry-after-ms", str(int(exc.retry_after_s * 1000))),)
        return grpc.StatusCode.RESOURCE_EXHAUSTED, exc.message, retry
    if isinstance(exc, errors.UnavailableError):
        retry = (("retry-after-ms", str(int(exc.retry_after_s * 1000))),)
        return grpc.StatusCode.UNAVAILABLE, exc.message, retry
    if isinstance(exc, errors.UnauthenticatedError):
        return grpc.StatusCode.UNAUTHENTICATED, exc.message, ()
    if isinstance(exc, errors.PermissionDeniedError):
        return grpc.StatusCode.PERMISSION_DENIED, exc.message, ()
    if isinstance(exc, asyncio.TimeoutError | TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded", ()
    if isinstance(exc, grpc.aio.AioRpcError) and exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
        # A downstream call ran out of the deadline it inherited from this call.
        return grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded", ()
    if errors.storage_full(exc):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, errors.STORAGE_FULL_MESSAGE, ()
    return grpc.StatusCode.INTERNAL, "internal error", ()


class ForgeServerInterceptor(grpc.aio.ServerInterceptor):
    """Auth, default deadline, error mapping, metrics and logs for every handler."""

    def __init__(
        self,
        service: str,
        token: str | None,
        default_deadline_s: float,
        authenticators: Sequence[Authenticator] = (),
    ) -> None:
        self._service = service
        self._token = token
        self._default_deadline_s = default_deadline_s
        self._authenticators = tuple(authenticators)

    async def authenticate(self, header: str | bytes | None) -> Principal | None:
        """The principal of an ``authorization`` header, or None when no token matches."""
        if self._token is not None and _token_matches(header, self._token):
            return SERVICE_PRINCIPAL
        presented = _bearer(header)
        if presented is None:
            return None
        for authenticate in self._authenticators:
            found = authenticate(presented)
            principal = await found if inspect.isawaitable(found) else found
            if principal is not None:
                return principal
        return None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        if method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        if self._token is None:
            return _wrap_handler(handler, self, method, True, None)
        principal = await self.authenticate(metadata.get("authorization"))
        return _wrap_handler(handler, self, method, principal is not None, principal)

    def _enter(self, context: grpc.aio.ServicerContext) -> float:
        remaining = context.time_remaining()
        budget = self._default_deadline_s if remaining is None else remaining
        return time.monotonic() + budget

    async def _fail(self, context: grpc.aio.ServicerContext, method: str, exc: BaseException) -> None:
        code, message, trailers = _status_for(exc)
        if code is grpc.StatusCode.INTERNAL:
            log.exception("grpc.unhandled", method=method)
        GRPC_REQUESTS.labels(self._service, method, code.name).inc()
        if trailers:
            context.set_trailing_metadata(trailers)
        await context.abort(code, message)

    def _done(self, method: str, started: float, code: str = "OK") -> None:
        GRPC_REQUESTS.labels(self._service, method, code).inc()
        GRPC_LATENCY.labels(self._service, method).observe(time.monotonic() - started)

    def _aborted(self, context: grpc.aio.ServicerContext, method: str, started: float) -> None:
        # The handler aborted with a status of its own choosing; count it under that status.
        code = context.code()
        name = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
        self._done(method, started, name)


def _code_name(code: object) -> str:
    return code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"


def _wrap_handler(
    handler: grpc.RpcMethodHandler,
    icpt: ForgeServerInterceptor,
    method: str,
    authorized: bool,
    principal: Principal | None,
) -> grpc.RpcMethodHandler:
    async def guard(context: grpc.aio.ServicerContext) -> float:
        if not authorized:
            await icpt._fail(context, method, errors.UnauthenticatedError("missing or invalid bearer token"))
        return icpt._enter(context)

    def unary_response(
        behavior: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]],
    ) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
        async def run(request: Any, context: grpc.aio.ServicerContext) -> Any:
            deadline = await guard(context)
            token = current_deadline.set(deadline)
            who = _current_principal.set(principal)
            admin_actions: list[str] = []
            asked = _admin_actions.set(admin_actions)
            started = time.monotonic()
            outcome = "OK"
            try:
                response = await asyncio.wait_for(
                    behavior(request, context), timeout=max(0.0, deadline - time.monotonic())
                )
            except grpc.aio.AbortError:
                icpt._aborted(context, method, started)
                outcome = _code_name(context.code())
                raise
            except asyncio.CancelledError:
                outcome = "CANCELLED"
                raise
            except BaseException as exc:
                outcome = _status_for(exc)[0].name
                await icpt._fail(context, method, exc)
                raise
            finally:
                current_deadline.reset(token)
                _current_principal.reset(who)
                _admin_actions.reset(asked)
                for action in admin_actions:
                    audit.record(action, principal.name if principal else "anonymous", outcome, method=method)
            icpt._done(method, started)
            return response

        return run

    def stream_response(
        behavior: Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]],
    ) -> Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]:
        async def run(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            # Streams are long-lived (watches, agent sessions): the default deadline applies only
            # to unary responses; a caller's explicit deadline still ends the stream.
            await guard(context)
            remaining = context.time_remaining()
            token = current_deadline.set(None if remaining is None else time.monotonic() + remaining)
            who = _current_principal.set(principal)
            started = time.monotonic()
            try:
                async for item in behavior(request, context):
                    yield item
            except grpc.aio.AbortError:
                icpt._aborted(context, method, started)
                raise
            except (asyncio.CancelledError, GeneratorExit):
                raise
            except BaseException as exc:
                await icpt._fail(context, method, exc)
                raise
            finally:
                current_deadline.reset(token)
                _current_principal.reset(who)
            icpt._done(method, started)

        return run

    # grpc's type stubs describe sync handlers; a grpc.aio server's handlers are coroutines.
    raw = cast(Any, handler)
    if raw.unary_unary:
        return grpc.unary_unary_rpc_method_handler(
            unary_response(raw.unary_unary),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    if raw.stream_unary:
        return grpc.stream_unary_rpc_method_handler(
            unary_response(raw.stream_unary),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    if raw.unary_stream:
        return grpc.unary_stream_rpc_method_handler(
            stream_response(raw.unary_stream),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    return grpc.stream_stream_rpc_method_handler(
        stream_response(raw.stream_stream),
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
