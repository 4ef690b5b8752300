"""Settings base class shared by every service.

Each service subclasses :class:`ServiceSettings` once, in its ``config.py``, and sets
``model_config = service_config("scheduler")``. Values come from init arguments, then environment
variables with the service prefix (``FORGE_SCHEDULER_GRPC_PORT``). A variable that carries the
prefix but names no field is an error at start-up: a typo must not silently fall back to a default.
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from forge_kit.eventauth import EventSigner, EventVerifier, KafkaAuth
from forge_kit.grpckit import TlsConfig
from forge_kit.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_MESSAGE_BYTES
from forge_kit.paths import private_dir

#: Secrets that shipped as defaults once, or that anyone would guess; no service runs with one.
KNOWN_DEFAULT_SECRETS = frozenset(
    {
        "forge-dev-token",
        "forge-dev-key",
        "forge",
        "changeme",
        "change-me",
        "secret",
        "password",
        "admin",
        "token",
    }
)
_KNOWN_DEFAULT_PATTERN = re.compile(r"^dev-token-[a-z0-9_-]*$")


def interpreter_path(value: str) -> str:
    """An interpreter setting as a child process can use it: a bare name (``python``) stays, to
    be looked up on ``PATH``; a relative path is made absolute against the working directory
    (children start in folders of their own, where it would name nothing)."""
    return os.path.abspath(value) if "/" in value and not os.path.isabs(value) else value


def is_known_default(value: str) -> bool:
    """True for a secret that is public knowledge: a former default or a ``dev-token-<service>``."""
    lowered = value.strip().lower()
    return lowered in KNOWN_DEFAULT_SECRETS or bool(_KNOWN_DEFAULT_PATTERN.fullmatch(lowered))


def default_secrets(settings: BaseSettings) -> list[str]:
    """Why ``settings`` must not run: an empty ``auth_token``, and every secret setting (any
    ``SecretStr`` field, nested settings included) whose value is a known default."""
    token = getattr(settings, "auth_token", None)
    empty = ["auth_token is empty"] if isinstance(token, SecretStr) and not token.get_secret_value() else []
    return empty + _known_defaults(settings, "")


def _known_defaults(settings: BaseSettings, prefix: str) -> list[str]:
    found: list[str] = []
    for name in type(settings).model_fields:
        value = getattr(settings, name)
        if isinstance(value, SecretStr) and is_known_default(value.get_secret_value()):
            found.append(f"{prefix}{name} is a known default secret")
        elif isinstance(value, BaseSettings):
            found += _known_defaults(value, f"{prefix}{name}.")
    return found


def service_config(service: str) -> SettingsConfigDict:
    """The pydantic-settings config for ``service``: env prefix ``FORGE_<SERVICE>_``, no extras."""
    return SettingsConfigDict(
        env_prefix=f"FORGE_{service.upper()}_",
        extra="forbid",
        validate_default=True,
        env_nested_delimiter="__",
        use_attribute_docstrings=True,
    )


class ForgeSettings(BaseSettings):
    """Base for every settings class: rejects unknown keys, including unknown prefixed env vars."""

    # Attribute docstrings become field descriptions, so ``--help`` and docs can show them.
    model_config = SettingsConfigDict(extra="forbid", use_attribute_docstrings=True)

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown_env(cls, data: Any) -> Any:
        prefix = str(cls.model_config.get("env_prefix") or "")
        if not prefix:
            return data
        known = {name.upper() for name in cls.model_fields}
        unknown = sorted(
            key
            for key in os.environ
            if key.upper().startswith(prefix.upper())
            and key[len(prefix) :].upper().split("__", 1)[0] not in known
        )
        if unknown:
            raise ValueError(f"unknown setting(s) in the environment: {', '.join(unknown)}")
        return data


class ServiceSettings(ForgeSettings):
    """Fields every Forge service has. Subclasses add their own, each with a docstring."""

    service_name: str = ""
    """Name used in logs, metrics and event producers; defaults to the env prefix's service."""

    host: str = "127.0.0.1"
    """Interface the gRPC and HTTP servers bind to."""

    grpc_port: int = Field(default=0, ge=0, le=65535)
    """gRPC port; 0 picks a free port (tests)."""

    http_port: int = Field(default=0, ge=0, le=65535)
    """HTTP port for health, readiness, metrics and any HTTP API; 0 picks a free port."""

    auth_token: SecretStr = SecretStr("")
    """Bearer token callers must present in gRPC metadata / HTTP Authorization. No default: a
    service refuses to start without one, or with a known default (:func:`default_secrets`)."""

    default_deadline_s: float = Field(default=30.0, gt=0)
    """Deadline applied to incoming gRPC calls whose caller set none."""

    http_max_body_bytes: int = Field(default=DEFAULT_MAX_BODY_BYTES, ge=1024)
    """Largest HTTP request body accepted; a larger one is answered 413 before it is read."""

    grpc_max_receive_bytes: int = Field(default=DEFAULT_MAX_MESSAGE_BYTES, ge=1024)
    """Largest gRPC request message accepted (RESOURCE_EXHAUSTED beyond)."""

    database_url: str = ""
    """SQLAlchemy async URL; empty means a SQLite file under ``data_dir``."""

    data_dir: str = "var/data"
    """Directory for this service's local state (SQLite file, caches)."""

    kafka_bootstrap: str = "127.0.0.1:19092"
    """Kafka bootstrap servers, comma separated."""

    kafka_enabled: bool = True
    """Publish and consume events; off only for isolated unit runs."""

    kafka_security_protocol: Literal["PLAINTEXT", "SASL_PLAINTEXT", "SASL_SSL", "SSL"] = "PLAINTEXT"
    """How Kafka clients reach the broker: PLAINTEXT (the local broker) or SASL (compose, Kubernetes)."""

    kafka_sasl_mechanism: Literal["SCRAM-SHA-512", "SCRAM-SHA-256"] = "SCRAM-SHA-512"
    """SASL mechanism when ``kafka_security_protocol`` is SASL_*."""

    kafka_sasl_username: str = ""
    """SASL user of this service on the broker (its ACLs name what it may read and write)."""

    kafka_sasl_password: SecretStr = SecretStr("")
    """SASL password of ``kafka_sasl_username``."""

    kafka_ca_file: str = ""
    """PEM CA bundle of the broker's certificate when ``kafka_security_protocol`` uses TLS."""

    event_signing_key: SecretStr = SecretStr("")
    """This service's Ed25519 event signing key (URL-safe base64 of the 32-byte seed); every
    event it publishes is signed with it. Required when it publishes events with Kafka on."""

    event_verify_keys: dict[str, str] = Field(default_factory=dict)
    """Producer name → its Ed25519 public key(s) (URL-safe base64, comma separated during a
    rotation), as JSON; events from anyone else are dropped by this service's consumers."""

    redis_url: str = ""
    """Redis URL for cache and rate limits; empty means in-process."""

    object_store_url: str = "var/objects"
    """fsspec URL (or local path) of the object store root."""

    tls_cert_file: str = ""
    """PEM certificate this service presents (server and client side); set all three TLS fields
    to turn on mutual TLS for its gRPC server and every channel it opens."""

    tls_key_file: str = ""
    """PEM private key of ``tls_cert_file``."""

    tls_ca_file: str = ""
    """PEM CA bundle that signs every Forge service's certificate."""

    log_level: str = "INFO"
    """Root log level."""

    log_json: bool = True
    """Emit JSON log lines (False: human-readable console lines)."""

    @model_validator(mode="after")
    def _default_service_name(self) -> ServiceSettings:
        if not self.service_name:
            prefix = str(self.model_config.get("env_prefix") or "FORGE_SERVICE_")
            self.service_name = prefix.removeprefix("FORGE_").rstrip("_").lower()
        return self

    def sqlite_url(self, filename: str) -> str:
        """The database URL to use: ``database_url`` if set, else ``<data_dir>/<filename>``
        (``data_dir`` made private: 0700)."""
        if self.database_url:
            return self.database_url
        private_dir(self.data_dir)
        return f"sqlite+aiosqlite:///{os.path.abspath(os.path.join(self.data_dir, filename))}"

    @model_validator(mode="after")
    def _tls_all_or_nothing(self) -> ServiceSettings:
        given = {name: bool(getattr(self, name)) for name in ("tls_cert_file", "tls_key_file", "tls_ca_file")}
        if any(given.values()) and not all(given.values()):
            missing = ", ".join(name for name, ok in given.items() if not ok)
            raise ValueError(
                f"mutual TLS needs all of tls_cert_file, tls_key_file, tls_ca_file; missing: {missing}"
            )
        for name, ok in given.items():
            if ok and not os.path.isfile(getattr(self, name)):
                raise ValueError(f"{name}: no such file: {getattr(self, name)}")
        return self

    @model_validator(mode="after")
    def _event_keys_parse(self) -> ServiceSettings:
        self.event_signer()
        self.event_verifier()
        if self.kafka_security_protocol.startswith("SASL") and not (
            self.kafka_sasl_username and self.kafka_sasl_password.get_secret_value()
        ):
            raise ValueError(
                f"kafka_security_protocol {self.kafka_security_protocol} needs a SASL username and password"
            )
        return self

    def event_signer(self) -> EventSigner | None:
        """The signer of this service's events, or None when no signing key is set."""
        secret = self.event_signing_key.get_secret_value()
        return EventSigner.from_secret(self.service_name, secret) if secret else None

    def event_verifier(self) -> EventVerifier:
        """Verifies events against ``event_verify_keys``."""
        return EventVerifier(self.event_verify_keys)

    def kafka_auth(self) -> KafkaAuth:
        """How this service's Kafka clients authenticate."""
        return KafkaAuth(
            security_protocol=self.kafka_security_protocol,
            sasl_mechanism=self.kafka_sasl_mechanism,
            username=self.kafka_sasl_username,
            password=self.kafka_sasl_password.get_secret_value(),
            ca_file=self.kafka_ca_file,
        )

    def tls(self) -> TlsConfig | None:
        """The mutual-TLS configuration, or None when TLS is off."""
        if not self.tls_cert_file:
            return None
        return TlsConfig(cert_file=self.tls_cert_file, key_file=self.tls_key_file, ca_file=self.tls_ca_file)
