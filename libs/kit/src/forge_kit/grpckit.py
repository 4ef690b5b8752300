"""gRPC server and client kit.

Server side, :func:`serve` starts a ``grpc.aio`` server with the standard health service,
reflection and :class:`ForgeServerInterceptor`, which for every call:

1. checks the bearer token (health and reflection are open, as probes expect) and records who
   called as the :func:`current_principal`: the service token is the ``admin`` principal; a
   service may accept more tokens (e.g. the scheduler's team tokens) through ``authenticators``;
2. applies the default deadline when the caller set none, and records the effective deadline so
   that downstream calls made while handling inherit what is left of it;
3. maps domain errors (:mod:`forge_kit.errors`) to status codes — ``INVALID_ARGUMENT`` naming the
   field, ``NOT_FOUND``, ``RESOURCE_EXHAUSTED`` — and anything else to ``INTERNAL`` without leaking
   internals;
4. counts and times the call in Prometheus and logs it.

Client side, :func:`make_channel` builds a channel with bounded, jittered retries (gRPC's own
retry policy, whose backoff is randomised per attempt) and an interceptor that adds the bearer
token and propagates the current deadline.
"""

from __future__ import annotations

import asyncio
import contextvars
import datetime as dt
import inspect
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import grpc
import structlog
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import Counter, Histogram

from forge_kit import audit, errors
from forge_kit.limits import DEFAULT_MAX_MESSAGE_BYTES

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
    if isinstance(exc, errors.UnauthenticatedError):
        return grpc.StatusCode.UNAUTHENTICATED, exc.message, ()
    if isinstance(exc, errors.PermissionDeniedError):
        return grpc.StatusCode.PERMISSION_DENIED, exc.message, ()
    if isinstance(exc, asyncio.TimeoutError | TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded", ()
    if isinstance(exc, grpc.aio.AioRpcError) and exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
        # A downstream call ran out of the deadline it inherited from this call.
        return grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded", ()
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


@dataclass
class GrpcServer:
    """A started server: its bound port and the health servicer to flip serving status."""

    server: grpc.aio.Server
    port: int
    health: health_aio.HealthServicer
    service_names: tuple[str, ...] = ()

    async def set_serving(self, serving: bool) -> None:
        """Mark every registered service (and the server as a whole, ``""``) SERVING or NOT_SERVING."""
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop accepting calls, let in-flight calls finish within ``grace_s``."""
        await self.set_serving(False)
        await self.server.stop(grace_s)


@dataclass(frozen=True)
class TlsConfig:
    """Mutual TLS between services: this process's certificate and key, and the CA that signs
    every peer. Servers require a client certificate from that CA; clients verify the server's."""

    cert_file: str
    key_file: str
    ca_file: str

    def _read(self) -> tuple[bytes, bytes, bytes]:
        with (
            open(self.cert_file, "rb") as cert,
            open(self.key_file, "rb") as key,
            open(self.ca_file, "rb") as ca,
        ):
            return cert.read(), key.read(), ca.read()

    def server_credentials(self) -> grpc.ServerCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


#: The identity this process presents when it calls other services; set once at start-up by
#: :class:`forge_kit.app.ServiceApp` from the service's settings, so every channel the process
#: opens is mutually authenticated without each call site passing certificates around.
_default_client_tls: TlsConfig | None = None


def set_default_client_tls(tls: TlsConfig | None) -> None:
    """Make :func:`make_channel` use ``tls`` when its caller does not pass one."""
    global _default_client_tls
    _default_client_tls = tls


async def serve(
    *,
    service: str,
    register: Sequence[Callable[[grpc.aio.Server], None]],
    service_names: Iterable[str],
    host: str,
    port: int,
    token: str | None,
    default_deadline_s: float,
    max_concurrent_rpcs: int | None = None,
    tls: TlsConfig | None = None,
    authenticators: Sequence[Authenticator] = (),
    max_receive_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> GrpcServer:
    """Start a gRPC server with health, reflection and the Forge interceptor; mutual TLS when
    ``tls`` is given (a plaintext or certificate-less client is then refused at the handshake).

    ``register`` are callables such as ``lambda s: pb2_grpc.add_XServicer_to_server(impl, s)``;
    ``service_names`` are the full names (``forge.scheduler.v1.SchedulerService``) to expose in
    reflection and health. A request message over ``max_receive_bytes`` is refused with
    RESOURCE_EXHAUSTED before any handler sees it.
    """
    server = grpc.aio.server(
        interceptors=[ForgeServerInterceptor(service, token, default_deadline_s, authenticators)],
        maximum_concurrent_rpcs=max_concurrent_rpcs,
        options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", max_receive_bytes)],
    )
    for add in register:
        add(server)
    health_servicer = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    address = f"{host}:{port}"
    bound = (
        server.add_secure_port(address, tls.server_credentials())
        if tls
        else server.add_insecure_port(address)
    )
    await server.start()
    for name in names:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return GrpcServer(server=server, port=bound, health=health_servicer, service_names=tuple(names))


class _ClientInterceptor(
    grpc.aio.UnaryUnaryClientInterceptor,
    grpc.aio.UnaryStreamClientInterceptor,
    grpc.aio.StreamUnaryClientInterceptor,
    grpc.aio.StreamStreamClientInterceptor,
):
    """Adds the bearer token and caps the timeout at what is left of the current deadline."""

    def __init__(self, token: str | None) -> None:
        self._token = token

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        if self._token is not None and "authorization" not in metadata:
            metadata.add("authorization", f"Bearer {self._token}")
        timeout = details.timeout
        left = remaining_deadline()
        if left is not None:
            timeout = left if timeout is None else min(timeout, left)
        return grpc.aio.ClientCallDetails(
            method=details.method,
            timeout=timeout,
            metadata=metadata,
            credentials=details.credentials,
            wait_for_ready=details.wait_for_ready,
        )

    async def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def,override]
        return await continuation(self._details(client_call_details), request)

    async def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def,override]
        return await continuation(self._details(client_call_details), request)

    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def,override]
        return await continuation(self._details(client_call_details), request_iterator)

    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def,override]
        return await continuation(self._details(client_call_details), request_iterator)


# grpc.aio files an interceptor under the FIRST call type it implements (an if/elif chain), so
# one interceptor implementing all four would only ever see unary-unary calls. Register one
# delegate per call type instead.
class _UnaryUnaryDelegate(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, inner: _ClientInterceptor) -> None:
        self._inner = inner

    async def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def,override]
        return await self._inner.intercept_unary_unary(continuation, client_call_details, request)


class _UnaryStreamDelegate(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, inner: _ClientInterceptor) -> None:
        self._inner = inner

    async def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def,override]
        return await self._inner.intercept_unary_stream(continuation, client_call_details, request)


class _StreamUnaryDelegate(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, inner: _ClientInterceptor) -> None:
        self._inner = inner

    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def,override]
        return await self._inner.intercept_stream_unary(continuation, client_call_details, request_iterator)


class _StreamStreamDelegate(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, inner: _ClientInterceptor) -> None:
        self._inner = inner

    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def,override]
        return await self._inner.intercept_stream_stream(continuation, client_call_details, request_iterator)


def client_interceptors(token: str | None) -> list[grpc.aio.ClientInterceptor]:
    """Auth and deadline-propagation interceptors, one per call type."""
    inner = _ClientInterceptor(token)
    delegates: list[Any] = [
        _UnaryUnaryDelegate(inner),
        _UnaryStreamDelegate(inner),
        _StreamUnaryDelegate(inner),
        _StreamStreamDelegate(inner),
    ]
    return delegates


def retry_service_config(
    max_attempts: int = 4,
    initial_backoff_s: float = 0.1,
    max_backoff_s: float = 2.0,
    retryable: Sequence[str] = ("UNAVAILABLE",),
) -> str:
    """A gRPC service config with a bounded retry policy; gRPC jitters each backoff randomly."""
    return json.dumps(
        {
            "methodConfig": [
                {
                    "name": [{}],
                    "retryPolicy": {
                        "maxAttempts": max_attempts,
                        "initialBackoff": f"{initial_backoff_s}s",
                        "maxBackoff": f"{max_backoff_s}s",
                        "backoffMultiplier": 2,
                        "retryableStatusCodes": list(retryable),
                    },
                }
            ]
        }
    )


def make_channel(
    target: str,
    *,
    token: str | None = None,
    max_attempts: int = 4,
    initial_backoff_s: float = 0.1,
    max_backoff_s: float = 2.0,
    tls: TlsConfig | None = None,
) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel to ``target`` with auth, deadline propagation and retries; mutual
    TLS with ``tls``, or with the process default (:func:`set_default_client_tls`) when set."""
    options = [
        ("grpc.enable_retries", 1),
        ("grpc.service_config", retry_service_config(max_attempts, initial_backoff_s, max_backoff_s)),
        ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ]
    interceptors = client_interceptors(token)
    tls = tls or _default_client_tls
    if tls is not None:
        return grpc.aio.secure_channel(
            target, tls.channel_credentials(), options=options, interceptors=interceptors
        )
    return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)


async def check_health(target: str, timeout_s: float = 2.0, tls: TlsConfig | None = None) -> bool:
    """True when the server at ``target`` answers the standard health check with SERVING."""
    tls = tls or _default_client_tls
    channel = (
        grpc.aio.secure_channel(target, tls.channel_credentials())
        if tls
        else grpc.aio.insecure_channel(target)
    )
    async with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def timestamp_field(message: Any, field: str) -> dt.datetime | None:
    """The ``google.protobuf.Timestamp`` field ``field`` of ``message`` as an aware UTC datetime,
    or ``None`` when it is unset. A value outside Timestamp's range (years 1 to 9999) is the
    caller's error: :class:`~forge_kit.errors.ValidationError` naming the field, never INTERNAL."""
    if not message.HasField(field):
        return None
    stamp = getattr(message, field)
    try:
        return cast(dt.datetime, stamp.ToDatetime(tzinfo=dt.UTC))
    except (ValueError, OverflowError) as exc:
        raise errors.ValidationError(field, f"is outside the timestamp range (years 1-9999): {exc}") from exc
