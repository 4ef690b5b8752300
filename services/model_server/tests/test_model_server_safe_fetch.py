"""The image URL fetcher's refusals (schemes, credentials, internal addresses however spelled, DNS
answers that point inside, redirects to another host, size)."""

from __future__ import annotations

import ipaddress

import httpx
import pytest

from forge_model_server.entrypoints.safe_fetch import (
    FetchError,
    fetch_public,
    is_public_address,
    parse_networks,
)


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1", "0.0.0.0",
     "::1", "fe80::1", "fc00::1", "::ffff:127.0.0.1", "::ffff:169.254.169.254", "224.0.0.1", "240.0.0.1"],
)  # fmt: skip
def test_internal_addresses_are_not_public(address: str) -> None:
    assert not is_public_address(ipaddress.ip_address(address))


def test_public_addresses_are_public() -> None:
    assert is_public_address(ipaddress.ip_address("93.184.216.34"))
    assert is_public_address(ipaddress.ip_address("2606:2800:220:1:248:1893:25c8:1946"))


async def _never(host: str, port: int) -> list[str]:
    raise AssertionError("must not resolve")


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("file:///etc/passwd", "scheme"),
        ("gopher://x/", "scheme"),
        ("http://user:pw@example.com/a.png", "user name"),
        ("http://127.0.0.1/a.png", "internal"),
        ("http://[::1]:8080/a.png", "internal"),
        ("http://169.254.169.254/latest/meta-data/", "internal"),
        ("http://0x7f000001/a.png", "internal"),
    ],
)
async def test_fetch_refuses_before_connecting(url: str, why: str) -> None:
    async def resolve(host: str, port: int) -> list[str]:
        return ["127.0.0.1"]  # what a decimal/hex spelling of loopback resolves to

    with pytest.raises(FetchError, match=why):
        await fetch_public(url, max_bytes=100, timeout_s=5, resolve=resolve)


async def test_a_name_resolving_inside_is_refused_and_the_checked_address_is_the_one_dialled() -> None:
    async def rebinding(host: str, port: int) -> list[str]:
        return ["93.184.216.34", "10.0.0.5"]  # one public, one internal answer: refused

    with pytest.raises(FetchError, match="internal"):
        await fetch_public("http://images.example/a.png", max_bytes=100, timeout_s=5, resolve=rebinding)

    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/hop":
            return httpx.Response(302, headers={"location": "http://other.example/a.png"})
        if request.url.path == "/big":
            return httpx.Response(200, content=b"x" * 500)
        return httpx.Response(200, content=b"PNGDATA")

    async def public(host: str, port: int) -> list[str]:
        return ["93.184.216.34"]

    transport = httpx.MockTransport(answer)
    body = await fetch_public(
        "http://images.example/a.png", max_bytes=100, timeout_s=5, resolve=public, transport=transport
    )
    assert body == b"PNGDATA"
    # Dialled at the checked address, with the name only in Host; no credentials of any kind.
    assert seen[0].url.host == "93.184.216.34" and seen[0].headers["host"] == "images.example"
    assert "authorization" not in seen[0].headers and "cookie" not in seen[0].headers
    with pytest.raises(FetchError, match="another host"):
        await fetch_public(
            "http://images.example/hop", max_bytes=100, timeout_s=5, resolve=public, transport=transport
        )
    with pytest.raises(FetchError, match="at most 100"):
        await fetch_public(
            "http://images.example/big", max_bytes=100, timeout_s=5, resolve=public, transport=transport
        )
    # An operator's allow-list admits an internal network, and nothing else.
    allowed = parse_networks(["10.0.0.0/8"])
    got = await fetch_public(
        "http://10.0.0.5/a.png", max_bytes=100, timeout_s=5, allowed_networks=allowed, resolve=_never,
        transport=transport,
    )  # fmt: skip
    assert got == b"PNGDATA"
