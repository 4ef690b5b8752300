"""gRPC server and client kit.

Server side, :func:`serve` starts a ``grpc.aio`` server with the standard health service,
reflection (v1 and v1alpha, :mod:`forge_kit.grpc_reflection_v1`) and
:class:`~forge_kit.grpc_interceptor.ForgeServerInterceptor`, which authenticates
every call (:func:`current_principal`), applies and propagates its deadline, maps domain errors
to status codes and counts, logs and audits it (:mod:`forge_kit.grpc_interceptor`; its public
names are re-exported here, where handlers import them).

Client side, :func:`make_channel` builds a channel with bounded, jittered retries (gRPC's own
retry policy, whose backoff is randomised per attempt) and an interceptor that adds the bearer
token and propagates the current deadline.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import grpc
import structlog
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from forge_kit import errors
from forge_kit.grpc_interceptor import FIELD_METADATA_KEY as FIELD_METADATA_KEY
from forge_kit.grpc_interceptor import SERVICE_PRINCIPAL as SERVICE_PRINCIPAL
from forge_kit.grpc_interceptor import Authenticator as Authenticator
from forge_kit.grpc_interceptor import ForgeServerInterceptor
from forge_kit.grpc_interceptor import Principal as Principal
from forge_kit.grpc_interceptor import current_deadline as current_deadline
from forge_kit.grpc_interceptor import current_principal as current_principal
from forge_kit.grpc_interceptor import remaining_deadline as remaining_deadline
from forge_kit.grpc_interceptor import require_admin as require_admin
from forge_kit.grpc_reflection_v1 import enable_reflection
from forge_kit.limits import DEFAULT_MAX_MESSAGE_BYTES

log = structlog.get_logger(__name__)


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
    enable_reflection([*names, health.SERVICE_NAME], server)
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


class LazyChannel:
    """A :func:`make_channel` channel opened on first use, so that it belongs to the event loop
    that uses it (a Temporal worker's, a consumer's), not the one that built its owner; an
    activity class or a client holds one and calls :meth:`get` per call and :meth:`close` once
    at shutdown (idempotent; a later :meth:`get` opens a new channel)."""

    def __init__(self, target: str, token: str | None) -> None:
        self._target = target
        self._token = token
        self._channel: grpc.aio.Channel | None = None

    def get(self) -> grpc.aio.Channel:
        if self._channel is None:
            self._channel = make_channel(self._target, token=self._token)
        return self._channel

    async def close(self) -> None:
        if self._channel is not None:
            channel, self._channel = self._channel, None
            await channel.close(None)


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
