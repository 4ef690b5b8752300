"""A private CA and the certificates of Temporal's mutual TLS in Compose (``make secrets``).

Written once into a directory (mode 0700) and kept: ``ca.pem`` and ``ca.key`` (the key 0600,
never mounted anywhere), ``server.pem``/``server.key`` for the Temporal frontend and internode
traffic (names ``temporal``, ``localhost``, ``127.0.0.1``), and one client pair per client
(``orchestrator``, ``ui``, ``admin`` for Temporal's own setup and health check). Only holders of a
certificate this CA signed can talk to Temporal at all.

The leaf keys are mode 0644 inside the 0700 directory: Compose bind-mounts each file into a
container whose user is not the host user, and the directory keeps other host users out.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CLIENTS = ("orchestrator", "ui", "admin")
VALID_DAYS = 825
SERVER_NAME = "temporal"


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Forge"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    path.chmod(mode)


def _issue(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    common_name: str,
    *,
    server: bool,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH] + ([ExtendedKeyUsageOID.SERVER_AUTH] if server else [])
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    )
    if server:
        names: list[x509.GeneralName] = [
            x509.DNSName(SERVER_NAME),
            x509.DNSName("localhost"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        ]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def write(directory: Path) -> list[Path]:
    """Create the CA and every certificate missing from ``directory``; returns the files written."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    written: list[Path] = []
    ca_pem, ca_key_file = directory / "ca.pem", directory / "ca.key"
    if ca_pem.exists() and ca_key_file.exists():
        ca_cert = x509.load_pem_x509_certificate(ca_pem.read_bytes())
        loaded = serialization.load_pem_private_key(ca_key_file.read_bytes(), password=None)
        if not isinstance(loaded, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{ca_key_file} is not an EC private key")
        ca_key = loaded
    else:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        ca_cert = (
            x509.CertificateBuilder()
            .subject_name(_name("Forge Temporal CA"))
            .issuer_name(_name("Forge Temporal CA"))
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(ca_key, hashes.SHA256())
        )
        _write(ca_key_file, _key_pem(ca_key), 0o600)
        _write(ca_pem, ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)
        written += [ca_key_file, ca_pem]
    for name, server in [("server", True), *((client, False) for client in CLIENTS)]:
        cert_file, key_file = directory / f"{name}.pem", directory / f"{name}.key"
        if cert_file.exists() and key_file.exists():
            continue
        key, cert = _issue(ca_key, ca_cert, SERVER_NAME if server else name, server=server)
        _write(key_file, _key_pem(key), 0o644)
        _write(cert_file, cert.public_bytes(serialization.Encoding.PEM), 0o644)
        written += [key_file, cert_file]
    return written
