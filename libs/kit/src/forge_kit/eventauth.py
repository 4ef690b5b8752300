"""Who published an event: Ed25519 signatures on every event envelope, and Kafka client credentials.

Each producing service holds one Ed25519 private key (``event_signing_key``, from the secrets
store); every consumer holds the public keys of the producers it may hear from
(``event_verify_keys``). Ed25519 rather than a shared HMAC key: a consumer can verify but never
sign, so a compromised consumer (or anyone reading its environment) cannot forge the events it
consumes, and the public keys need no secrecy when they are handed out.

What is signed (:func:`signing_input`): the topic, the event type, the event id, the producer's
name, the key id and the serialised payload, each length-prefixed, so no field can be moved into
another and a payload cannot be altered or replayed onto another topic or under another producer.
On the wire the signature travels (URL-safe base64, so every header stays text) in the
``forge-signature`` header and the key id (the first 16
hex digits of SHA-256 of the raw public key) in ``forge-key-id``, next to the existing
``forge-event-type``, ``forge-event-id`` and ``forge-producer`` headers.

A verifier answers with the authenticated producer or raises :class:`Rejected` with a reason:
``unsigned`` (no signature or key id), ``unknown_key`` (a key id no configured producer owns),
``wrong_producer`` (the key belongs to another producer than the header names),
``bad_signature`` (the bytes were altered, or signed with another key) or ``malformed``. Which
producers a topic accepts is the consumer's decision (:class:`forge_kit.consumer.EventConsumer`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from prometheus_client import Counter

log = structlog.get_logger(__name__)

HEADER_TYPE = "forge-event-type"
HEADER_ID = "forge-event-id"
HEADER_PRODUCER = "forge-producer"
HEADER_KEY_ID = "forge-key-id"
HEADER_SIGNATURE = "forge-signature"

#: Reasons an event is dropped, the label values of ``forge_events_rejected_total``.
REASONS = ("unsigned", "unknown_key", "wrong_producer", "bad_signature", "malformed")

EVENTS_REJECTED = Counter(
    "forge_events_rejected_total",
    "Events dropped because their producer could not be authenticated",
    ["group", "topic", "reason"],
)

_DOMAIN = b"forge-event-signature-v1"
_MAX_NAME = 255


class Rejected(Exception):
    """An event whose producer could not be authenticated; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def signing_input(
    *, topic: str, event_type: str, event_id: str, producer: str, key_id: str, payload: bytes
) -> bytes:
    """The exact bytes signed for one event: a domain tag, then each field length-prefixed."""
    parts = [
        topic.encode(),
        event_type.encode(),
        event_id.encode(),
        producer.encode(),
        key_id.encode(),
        payload,
    ]
    return _DOMAIN + b"".join(struct.pack(">I", len(p)) + p for p in parts)


def key_id_of(public: Ed25519PublicKey) -> str:
    """The key id: the first 16 hex digits of SHA-256 over the raw 32-byte public key."""
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def _b64decode(text: str, what: str, size: int) -> bytes:
    try:
        raw = base64.urlsafe_b64decode(text.strip() + "=" * (-len(text.strip()) % 4))
    except (binascii.Error, ValueError):
        raise ValueError(f"{what} is not base64") from None
    if len(raw) != size:
        raise ValueError(f"{what} must be {size} bytes, not {len(raw)}")
    return raw


def _b64encode(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def public_key_text(public: Ed25519PublicKey) -> str:
    """A public key as settings and key files hold it: unpadded URL-safe base64 of the raw bytes."""
    return _b64encode(public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))


class EventSigner:
    """Signs the events of one producer with its private key."""

    def __init__(self, producer: str, private: Ed25519PrivateKey) -> None:
        if not producer or len(producer) > _MAX_NAME:
            raise ValueError("producer must be 1-255 characters")
        self.producer = producer
        self._private = private
        self.public_key = private.public_key()
        self.key_id = key_id_of(self.public_key)

    @classmethod
    def generate(cls, producer: str) -> EventSigner:
        """A signer with a fresh random key."""
        return cls(producer, Ed25519PrivateKey.generate())

    @classmethod
    def from_secret(cls, producer: str, secret: str) -> EventSigner:
        """A signer from :meth:`secret`'s text (URL-safe base64 of the 32-byte private seed)."""
        seed = _b64decode(secret, "event signing key", 32)
        return cls(producer, Ed25519PrivateKey.from_private_bytes(seed))

    def secret(self) -> str:
        """The private key as text, for the secrets store. Never log it."""
        raw = self._private.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )
        return _b64encode(raw)

    def public(self) -> str:
        """The public key as text, for consumers' ``event_verify_keys``."""
        return public_key_text(self.public_key)

    def sign(self, *, topic: str, event_type: str, event_id: str, payload: bytes) -> str:
        """The signature of one event published by this producer, as header text."""
        raw = self._private.sign(
            signing_input(
                topic=topic,
                event_type=event_type,
                event_id=event_id,
                producer=self.producer,
                key_id=self.key_id,
                payload=payload,
            )
        )
        return _b64encode(raw)

    def headers(self, topic: str, event_type: str, event_id: str, payload: bytes) -> list[tuple[str, bytes]]:
        """Every header of a record carrying this event: type, id, producer, key id, signature."""
        signature = self.sign(topic=topic, event_type=event_type, event_id=event_id, payload=payload)
        return [
            (HEADER_TYPE, event_type.encode()),
            (HEADER_ID, event_id.encode()),
            (HEADER_PRODUCER, self.producer.encode()),
            (HEADER_KEY_ID, self.key_id.encode()),
            (HEADER_SIGNATURE, signature.encode()),
        ]


@dataclass(frozen=True)
class _Known:
    producer: str
    key: Ed25519PublicKey


class EventVerifier:
    """Checks events against the public keys of known producers.

    ``keys`` maps a producer to its public key(s): one key as text, several separated by commas
    (a rotation: the old and the new key both verify until the old is dropped).
    """

    def __init__(self, keys: Mapping[str, str | Iterable[str]]) -> None:
        self._by_id: dict[str, _Known] = {}
        for producer, value in keys.items():
            texts = value.split(",") if isinstance(value, str) else list(value)
            for text in (t.strip() for t in texts):
                if not text:
                    continue
                raw = _b64decode(text, f"event verify key of {producer!r}", 32)
                public = Ed25519PublicKey.from_public_bytes(raw)
                key_id = key_id_of(public)
                held = self._by_id.get(key_id)
                if held is not None and held.producer != producer:
                    raise ValueError(
                        f"one event key is configured for both {held.producer!r} and {producer!r}"
                    )
                self._by_id[key_id] = _Known(producer, public)

    @property
    def producers(self) -> frozenset[str]:
        """Producers with at least one key."""
        return frozenset(k.producer for k in self._by_id.values())

    def verify(self, *, topic: str, headers: Mapping[str, bytes], payload: bytes) -> str:
        """The authenticated producer of the event, or :class:`Rejected`."""
        signature = headers.get(HEADER_SIGNATURE)
        key_id_raw = headers.get(HEADER_KEY_ID)
        if not signature or not key_id_raw:
            raise Rejected("unsigned", "no signature or key id header")
        try:
            key_id = key_id_raw.decode()
            producer = headers.get(HEADER_PRODUCER, b"").decode()
            event_type = headers.get(HEADER_TYPE, b"").decode()
            event_id = headers.get(HEADER_ID, b"").decode()
            raw_signature = _b64decode(signature.decode(), "signature", 64)
        except UnicodeDecodeError:
            raise Rejected("malformed", "a header is not UTF-8") from None
        except ValueError:
            raise Rejected("malformed", "the signature is not 64 bytes of base64") from None
        known = self._by_id.get(key_id)
        if known is None:
            raise Rejected("unknown_key", f"key id {key_id[:32]!r} belongs to no known producer")
        if known.producer != producer:
            raise Rejected("wrong_producer", f"key of {known.producer!r} on an event from {producer[:64]!r}")
        try:
            known.key.verify(
                raw_signature,
                signing_input(
                    topic=topic,
                    event_type=event_type,
                    event_id=event_id,
                    producer=producer,
                    key_id=key_id,
                    payload=payload,
                ),
            )
        except InvalidSignature:
            raise Rejected("bad_signature", f"signature does not match the event (key {key_id})") from None
        return producer


def record_rejection(group: str, topic: str, rejected: Rejected, **fields: Any) -> None:
    """Count a dropped event and log why (one structured line, no payload)."""
    EVENTS_REJECTED.labels(group, topic, rejected.reason).inc()
    log.warning(
        "event.rejected", group=group, topic=topic, reason=rejected.reason, detail=rejected.detail, **fields
    )


@dataclass(frozen=True)
class KafkaAuth:
    """How a Kafka client authenticates to the broker: plain (the local broker) or SASL/SCRAM."""

    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str = ""
    username: str = ""
    password: str = ""
    ca_file: str = ""

    def client_options(self) -> dict[str, Any]:
        """Keyword arguments for aiokafka's producer, consumer and admin client."""
        options: dict[str, Any] = {"security_protocol": self.security_protocol}
        if self.security_protocol in ("SASL_PLAINTEXT", "SASL_SSL"):
            options.update(
                sasl_mechanism=self.sasl_mechanism or "SCRAM-SHA-512",
                sasl_plain_username=self.username,
                sasl_plain_password=self.password,
            )
        if self.security_protocol in ("SSL", "SASL_SSL"):
            from aiokafka.helpers import create_ssl_context

            options["ssl_context"] = create_ssl_context(cafile=self.ca_file or None)
        return options


PLAINTEXT = KafkaAuth()
