"""forge_kit.eventauth: signatures over events, the verifier's verdicts, Kafka client credentials."""

from __future__ import annotations

import pytest
from aiokafka import AIOKafkaProducer

from forge_kit.eventauth import (
    HEADER_KEY_ID,
    HEADER_PRODUCER,
    HEADER_SIGNATURE,
    EventSigner,
    EventVerifier,
    KafkaAuth,
    Rejected,
)
from forge_kit.settings import ServiceSettings, default_secrets, is_known_default

TOPIC = "forge.scheduler.job_state_changed.v1"
TYPE = "forge.events.v1.JobStateChanged"


def _headers(signer: EventSigner, payload: bytes = b"payload", **over: bytes) -> dict[str, bytes]:
    headers = dict(signer.headers(TOPIC, TYPE, "ev-1", payload))
    headers.update(over)
    return headers


def _reason(
    verifier: EventVerifier, headers: dict[str, bytes], payload: bytes = b"payload", topic: str = TOPIC
) -> str:
    with pytest.raises(Rejected) as caught:
        verifier.verify(topic=topic, headers=headers, payload=payload)
    return caught.value.reason


def test_a_signed_event_verifies_as_its_producer() -> None:
    signer = EventSigner.generate("scheduler")
    verifier = EventVerifier({"scheduler": signer.public()})
    assert verifier.verify(topic=TOPIC, headers=_headers(signer), payload=b"payload") == "scheduler"


def test_every_forgery_is_rejected_with_its_reason() -> None:
    scheduler, eval_ = EventSigner.generate("scheduler"), EventSigner.generate("eval")
    verifier = EventVerifier({"scheduler": scheduler.public(), "eval": eval_.public()})
    good = _headers(scheduler)
    assert _reason(verifier, {k: v for k, v in good.items() if k != HEADER_SIGNATURE}) == "unsigned"
    assert _reason(verifier, _headers(EventSigner.generate("scheduler"))) == "unknown_key"
    assert _reason(verifier, _headers(eval_, **{HEADER_PRODUCER: b"scheduler"})) == "wrong_producer"
    assert _reason(verifier, good, payload=b"altered") == "bad_signature"
    assert _reason(verifier, good, topic="forge.eval.model_promoted.v1") == "bad_signature"
    assert _reason(verifier, {**good, "forge-event-id": b"ev-2"}) == "bad_signature"
    assert _reason(verifier, {**good, HEADER_SIGNATURE: b"%%%"}) == "malformed"
    assert _reason(verifier, {**good, HEADER_KEY_ID: b"\xff"}) == "malformed"


def test_rotation_accepts_both_keys_and_a_key_belongs_to_one_producer() -> None:
    old, new = EventSigner.generate("eval"), EventSigner.generate("eval")
    verifier = EventVerifier({"eval": f"{old.public()}, {new.public()}"})
    assert verifier.verify(topic=TOPIC, headers=_headers(old), payload=b"payload") == "eval"
    assert verifier.verify(topic=TOPIC, headers=_headers(new), payload=b"payload") == "eval"
    with pytest.raises(ValueError, match="both"):
        EventVerifier({"eval": old.public(), "retriever": old.public()})
    with pytest.raises(ValueError, match="32 bytes"):
        EventVerifier({"eval": "c2hvcnQ"})


def test_the_secret_round_trips_and_headers_are_text() -> None:
    signer = EventSigner.generate("retriever")
    again = EventSigner.from_secret("retriever", signer.secret())
    assert again.key_id == signer.key_id and again.public() == signer.public()
    assert all(value.decode().isascii() for _, value in signer.headers(TOPIC, TYPE, "i", b"\x00\xff"))


async def test_sasl_settings_become_aiokafka_options() -> None:
    options = KafkaAuth("SASL_PLAINTEXT", "SCRAM-SHA-512", "eval", "pw").client_options()
    assert options == {
        "security_protocol": "SASL_PLAINTEXT",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "eval",
        "sasl_plain_password": "pw",
    }
    AIOKafkaProducer(bootstrap_servers="127.0.0.1:1", **options)  # aiokafka accepts every option
    assert KafkaAuth().client_options() == {"security_protocol": "PLAINTEXT"}


def test_settings_reject_sasl_without_credentials_and_flag_known_defaults() -> None:
    class Settings(ServiceSettings):
        pass

    with pytest.raises(ValueError, match="SASL username and password"):
        Settings(kafka_security_protocol="SASL_PLAINTEXT")
    assert default_secrets(Settings(auth_token="a-real-token")) == []
    assert default_secrets(Settings()) == ["auth_token is empty"]
    assert default_secrets(Settings(auth_token="dev-token-scheduler")) == [
        "auth_token is a known default secret"
    ]
    assert is_known_default("Forge-Dev-Key") and not is_known_default("dev-token is not it")
