"""Caller images as hostile input (data URIs, formats, sizes, bombs, truncation) and the URL
fetcher's refusals (schemes, credentials, internal addresses however spelled, DNS answers that
point inside, redirects to another host, size)."""

from __future__ import annotations

import base64
import io
import ipaddress

import httpx
import pytest
from PIL import Image

from forge_kit.images import ImageError, decode_data_uri, open_image
from forge_kit.openai_protocol import ChatCompletionBody, ImageRef, message_parts, parse
from forge_kit.safe_fetch import FetchError, fetch_public, is_public_address, parse_networks


def _png(size: tuple[int, int] = (8, 6)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 10, 10)).save(buffer, "PNG")
    return buffer.getvalue()


def test_data_uris_decode_within_limits() -> None:
    png = _png()
    assert decode_data_uri("data:image/png;base64," + base64.b64encode(png).decode()) == png
    for uri, why in [
        ("data:text/plain;base64,aGk=", "not an image"),
        ("data:image/png,rawbytes", "base64"),
        ("data:image/png;base64,***", "invalid base64"),
        ("https://x/y.png", "not a data URI"),
        ("data:image/png;base64,", "empty"),
    ]:
        with pytest.raises(ImageError, match=why):
            decode_data_uri(uri)
    big = "data:image/png;base64," + base64.b64encode(b"\x00" * 2000).decode()
    with pytest.raises(ImageError, match="more than 1000 bytes"):
        decode_data_uri(big, max_bytes=1000)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_supported_formats_open_as_rgb(fmt: str) -> None:
    buffer = io.BytesIO()
    Image.new("RGB", (10, 7), (1, 2, 3)).save(buffer, fmt)
    image = open_image(buffer.getvalue())
    assert image.mode == "RGB" and image.size == (10, 7)


def test_unsupported_corrupt_and_oversized_images_are_refused() -> None:
    bmp = io.BytesIO()
    Image.new("RGB", (4, 4)).save(bmp, "BMP")
    with pytest.raises(ImageError, match="supported format"):
        open_image(bmp.getvalue())
    with pytest.raises(ImageError, match="supported format"):
        open_image(b"<svg xmlns='http://www.w3.org/2000/svg'/>")
    with pytest.raises(ImageError, match="corrupt or truncated"):
        open_image(_png((64, 64))[:-30])
    # A bomb is refused on its header: 20000 x 20000 declared, never decoded.
    with pytest.raises(ImageError, match="pixels"):
        open_image(_png((300, 300)), max_pixels=300 * 299)


def test_image_parts_are_checked_for_form_and_located() -> None:
    body = parse(
        ChatCompletionBody,
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                    ],
                },
            ],
        },
    )
    assert message_parts(body.messages[1], 1) == [
        "what",
        ImageRef("messages.1.content.1", "data:image/png;base64,AAAA"),
    ]
    bad = body.model_copy(deep=True)
    assert not isinstance(bad.messages[1].content, str) and bad.messages[1].content is not None
    bad.messages[1].content[1].image_url.url = "file:///etc/passwd"  # type: ignore[union-attr]
    with pytest.raises(Exception, match="data:image") as refused:
        message_parts(bad.messages[1], 1)
    assert getattr(refused.value, "field", None) == "messages.1.content.1"


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
