"""Images a caller sends (OpenAI ``image_url`` parts), read as hostile input.

- :func:`decode_data_uri`: ``data:image/<fmt>;base64,<payload>`` → bytes, with the encoded and
  decoded sizes bounded before and after decoding;
- :func:`open_image`: bytes → one RGB Pillow image, for the formats in :data:`IMAGE_FORMATS` only
  (recognised by their content, never by a claimed type), with the pixel count bounded *before*
  any pixel is decoded (a decompression bomb is refused on its header) and a truncated or corrupt
  file refused by a full decode.

Each refusal is an :class:`ImageError` whose message says what is wrong; the caller names the part
(``messages.0.content.1``). Pillow is imported on call: the kit itself does not need it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
from dataclasses import dataclass
from typing import Any

#: What an image may be: Pillow's names of the formats read.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
#: Default most bytes of one encoded image (after base64 decoding or download).
MAX_IMAGE_BYTES = 4 << 20
#: Default most pixels (width x height) of one image: 4096 x 4096.
MAX_IMAGE_PIXELS = 4096 * 4096
_DATA_URI = re.compile(
    r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,"
)


class ImageError(ValueError):
    """An image that cannot be taken; the message says why (never echoes the payload)."""


@dataclass(frozen=True)
class ImageBytes:
    """One encoded image as received, and the hash that identifies its content."""

    data: bytes
    sha256: str

    @classmethod
    def of(cls, data: bytes) -> ImageBytes:
        return cls(data, hashlib.sha256(data).hexdigest())


_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
)


def image_mime(data: bytes) -> str:
    """The media type of an encoded image from its first bytes (``application/octet-stream`` when
    none of :data:`IMAGE_FORMATS` is recognised)."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return next((mime for magic, mime in _MAGIC if data.startswith(magic)), "application/octet-stream")


def decode_data_uri(url: str, *, max_bytes: int = MAX_IMAGE_BYTES) -> bytes:
    """The bytes of a base64 ``data:`` URI of an image; :class:`ImageError` when it is not one,
    or when its payload is (or would decode to) more than ``max_bytes``."""
    match = _DATA_URI.match(url)
    if match is None:
        raise ImageError("is not a data URI (data:image/<format>;base64,<data>)")
    mime = (match.group("mime") or "").lower()
    if not mime.startswith("image/"):
        raise ImageError(f"has media type {mime or 'text/plain'!r}, not an image")
    if match.group("b64") is None:
        raise ImageError("must be base64-encoded (data:image/<format>;base64,...)")
    payload = url[match.end() :]
    # 4 characters carry 3 bytes: refuse an oversized payload before decoding any of it.
    if len(payload) > 4 * ((max_bytes + 2) // 3) + 4:
        raise ImageError(f"decodes to more than {max_bytes} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("has invalid base64 data") from None
    if len(data) > max_bytes:
        raise ImageError(f"is {len(data)} bytes; at most {max_bytes} are accepted")
    if not data:
        raise ImageError("is empty")
    return data


def open_image(data: bytes, *, max_pixels: int = MAX_IMAGE_PIXELS) -> Any:
    """``data`` decoded to one RGB ``PIL.Image.Image`` (the first frame of an animation).

    1. Identify the format from the header, among :data:`IMAGE_FORMATS` only.
    2. Bound width x height by ``max_pixels`` before decoding (a bomb is refused on its header).
    3. Decode every pixel (a truncated or corrupt file fails here, not later) and convert to RGB.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        # 1. Identify (Pillow reads the header only; ``formats`` stops it trying any other reader).
        image = Image.open(io.BytesIO(data), formats=list(IMAGE_FORMATS))
    except UnidentifiedImageError:
        raise ImageError(f"is not an image in a supported format ({', '.join(IMAGE_FORMATS)})") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise ImageError(f"cannot be read: {exc}") from None
    # 2. Bound the size.
    width, height = image.size
    if width < 1 or height < 1:
        raise ImageError(f"has an empty size {width}x{height}")
    if width * height > max_pixels:
        raise ImageError(f"is {width}x{height} pixels; at most {max_pixels} pixels are accepted")
    # 3. Decode all of it.
    try:
        image.seek(0)
        image.load()
        return image.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise ImageError(f"is corrupt or truncated ({image.format}): {exc}") from None
