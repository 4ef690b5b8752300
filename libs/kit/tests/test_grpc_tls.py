"""Mutual TLS between services: certificates made here with `cryptography`, a real server."""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from forge.rerank.v1 import rerank_pb2, rerank_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import ValidationError

from forge_kit.grpckit import GrpcServer, TlsConfig, check_health, make_channel, serve
from forge_kit.settings import ServiceSettings, service_config

TOKEN = "tls-token"


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
    path.with_suffix(".key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _issue(ca_key: ec.EllipticCurvePrivateKey, ca_name: x509.Name, common_name: str, path: Path) -> TlsConfig:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    _write(path, key, cert)
    return TlsConfig(
        str(path.with_suffix(".crt")), str(path.with_suffix(".key")), str(path.parent / "ca.crt")
    )


def _ca(path: Path, name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Name]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    subject = _name(name)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    _write(path / "ca", key, cert)
    return key, subject


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsConfig]:
    good = tmp_path_factory.mktemp("pki")
    ca_key, ca_name = _ca(good, "forge-test-ca")
    rogue = tmp_path_factory.mktemp("rogue")
    rogue_key, rogue_name = _ca(rogue, "someone-else")
    return {
        "server": _issue(ca_key, ca_name, "scheduler", good / "server"),
        "client": _issue(ca_key, ca_name, "orchestrator", good / "client"),
        "rogue": _issue(rogue_key, rogue_name, "intruder", rogue / "client"),
    }


class Echo(rerank_pb2_grpc.RerankerServiceServicer):
    async def Rerank(
        self, request: rerank_pb2.RerankRequest, context: grpc.aio.ServicerContext
    ) -> rerank_pb2.RerankResponse:
        return rerank_pb2.RerankResponse(model=request.query)


@pytest_asyncio.fixture
async def server(pki: dict[str, TlsConfig]) -> AsyncIterator[GrpcServer]:
    started = await serve(
        service="tls-test",
        register=[lambda s: rerank_pb2_grpc.add_RerankerServiceServicer_to_server(Echo(), s)],
        service_names=["forge.rerank.v1.RerankerService"],
        host="127.0.0.1",
        port=0,
        token=TOKEN,
        default_deadline_s=5,
        tls=pki["server"],
    )
    yield started
    await started.stop(0)


@pytest.mark.asyncio
async def test_mutually_authenticated_client_is_served(server: GrpcServer, pki: dict[str, TlsConfig]) -> None:
    async with make_channel(f"127.0.0.1:{server.port}", token=TOKEN, tls=pki["client"]) as channel:
        reply = await rerank_pb2_grpc.RerankerServiceStub(channel).Rerank(
            rerank_pb2.RerankRequest(query="hi"), timeout=5
        )
    assert reply.model == "hi"
    assert await check_health(f"127.0.0.1:{server.port}", tls=pki["client"])


@pytest.mark.asyncio
async def test_plaintext_client_is_refused(server: GrpcServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert not await check_health(f"127.0.0.1:{server.port}")


@pytest.mark.asyncio
async def test_client_without_a_certificate_or_from_another_ca_is_refused(
    server: GrpcServer, pki: dict[str, TlsConfig]
) -> None:
    ca_only = grpc.ssl_channel_credentials(root_certificates=Path(pki["client"].ca_file).read_bytes())
    async with grpc.aio.secure_channel(f"127.0.0.1:{server.port}", ca_only) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as no_cert:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
    assert no_cert.value.code() == grpc.StatusCode.UNAVAILABLE
    rogue = pki["rogue"]
    trusting_server = TlsConfig(rogue.cert_file, rogue.key_file, pki["client"].ca_file)
    assert not await check_health(f"127.0.0.1:{server.port}", tls=trusting_server)


class _Settings(ServiceSettings):
    model_config = service_config("tlsdemo")


def test_tls_settings_are_all_or_nothing(pki: dict[str, TlsConfig], monkeypatch: pytest.MonkeyPatch) -> None:
    assert _Settings().tls() is None
    client = pki["client"]
    full = _Settings(tls_cert_file=client.cert_file, tls_key_file=client.key_file, tls_ca_file=client.ca_file)
    assert full.tls() == client
    with pytest.raises(ValidationError, match="missing: tls_key_file, tls_ca_file"):
        _Settings(tls_cert_file=client.cert_file)
    with pytest.raises(ValidationError, match="tls_ca_file: no such file"):
        _Settings(
            tls_cert_file=client.cert_file, tls_key_file=client.key_file, tls_ca_file="/nonexistent/ca.crt"
        )
