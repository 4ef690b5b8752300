"""Event signing keys for tests: one Ed25519 key per producer name, derived from the name and a
random seed drawn once per test run, so the publishers, consumers and service processes a test
builds — in this process or a child, which inherits the seed through ``FORGE_TEST_EVENT_SEED`` —
all agree on who signed what, and no key is fixed in the source for anyone to reuse.

Only tests use these keys; in production every key comes from the secrets store (``forge up``,
``make secrets``).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Iterable

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from google.protobuf.message import Message

from forge_kit.eventauth import EventSigner, EventVerifier
from forge_kit.events import OWNERS, topic_for

_SIGNERS: dict[str, EventSigner] = {}
SEED_VARIABLE = "FORGE_TEST_EVENT_SEED"

#: Every producer that owns a topic.
PRODUCERS: tuple[str, ...] = tuple(sorted(set(OWNERS.values())))


def signer(producer: str) -> EventSigner:
    """The test signer of ``producer`` (the same object for the life of the process)."""
    if producer not in _SIGNERS:
        run_seed = os.environ.setdefault(SEED_VARIABLE, secrets.token_hex(16))
        seed = hashlib.sha256(f"forge-test-event-key:{run_seed}:{producer}".encode()).digest()
        _SIGNERS[producer] = EventSigner(producer, Ed25519PrivateKey.from_private_bytes(seed))
    return _SIGNERS[producer]


def verify_keys(producers: Iterable[str] = PRODUCERS) -> dict[str, str]:
    """Producer → public key text, as ``event_verify_keys`` holds them."""
    return {p: signer(p).public() for p in producers}


def verifier(producers: Iterable[str] = PRODUCERS) -> EventVerifier:
    """A verifier that knows the test keys of ``producers`` (default: every topic owner)."""
    return EventVerifier(verify_keys(producers))


def service_env(
    service: str, *, producers: Iterable[str] = PRODUCERS, extra: Iterable[str] = ()
) -> dict[str, str]:
    """``FORGE_<SERVICE>_EVENT_SIGNING_KEY`` (the service's own key) and ``_EVENT_VERIFY_KEYS``
    (the keys of ``producers`` and ``extra``) for a service process a test starts."""
    prefix = f"FORGE_{service.upper()}_"
    return {
        f"{prefix}EVENT_SIGNING_KEY": signer(service).secret(),
        f"{prefix}EVENT_VERIFY_KEYS": json.dumps(verify_keys([*producers, *extra])),
    }


def headers_for(event: Message, *, topic: str | None = None) -> list[tuple[str, bytes]]:
    """The Kafka headers ``event``'s producer (its ``meta.producer``) would send it with, signed
    with that producer's test key — for tests that hand records to ``EventConsumer.handle``."""
    meta = event.meta  # type: ignore[attr-defined]
    return signer(meta.producer).headers(
        topic=topic or topic_for(event),
        event_type=event.DESCRIPTOR.full_name,
        event_id=meta.event_id,
        payload=event.SerializeToString(),
    )
