"""Caller images as hostile input (data URIs, formats, sizes, bombs, truncation); the URL
fetcher's refusals are the model server's (``test_model_server_safe_fetch.py``)."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from forge_kit.images import ImageError, decode_data_uri, open_image
from forge_kit.openai_protocol import ChatCompletionBody, ImageRef, message_parts, parse


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
