"""Registered model endpoints: which spellings are the same address, what each one is sent."""

from __future__ import annotations

import pytest

from forge_eval.endpoints import EndpointRegistry, normalize_endpoint
from forge_kit import errors


def test_spellings_of_one_address_share_its_credential_and_others_get_none() -> None:
    registry = EndpointRegistry({"http://Gateway:8080/": "key", "https://ms.internal/v1": "", "": "ignored"})
    assert registry.urls() == ["http://gateway:8080", "https://ms.internal/v1"]
    for same in ("http://gateway:8080", "HTTP://GATEWAY:8080/", " http://gateway:8080 "):
        assert registry.is_registered(same) and registry.credential(same) == "key"
    for other in ("http://gateway:8081", "http://gateway", "http://gateway:8080/v1", "http://evil:8080"):
        assert not registry.is_registered(other) and registry.credential(other) == ""
    assert registry.credential("not a url") == ""


@pytest.mark.parametrize(
    "bad",
    [
        "ftp://gateway",
        "http://",
        "http://user:pw@gateway:8080",
        "http://gateway:8080/?x=1",
        "http://gateway:8080/#f",
        "http://gateway:8080/a/../b",
        "http://gate way",
        "http://gateway:99999",
    ],
)
def test_urls_that_could_land_elsewhere_or_carry_secrets_are_refused(bad: str) -> None:
    with pytest.raises(errors.ValidationError) as caught:
        normalize_endpoint(bad)
    assert caught.value.field == "endpoint"


def test_ipv6_literals_keep_their_brackets() -> None:
    assert normalize_endpoint("http://[::1]:8000/") == "http://[::1]:8000"
