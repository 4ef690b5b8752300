"""Chat messages with ``image_url`` parts → :class:`ChatMessage` with the images' bytes.

A part's URL is a base64 ``data:image/…`` URI (PNG, JPEG, WebP or GIF), or, only where the
operator allowed it (``IMAGE_URL_FETCH``, off by default), an http(s) URL fetched through
:func:`forge_model_server.entrypoints.safe_fetch.fetch_public` (public addresses only, no redirect to another host, a
size limit and a timeout, no credentials). Every refusal is a 400 naming the part
(``messages.0.content.1``); the pixels are decoded later, by the engine of a model that reads
images, with the pixel limit (a text-only model refuses the request before that).
"""

from __future__ import annotations

from dataclasses import dataclass

from forge_kit import errors
from forge_kit.images import MAX_IMAGE_BYTES, ImageBytes, ImageError, decode_data_uri
from forge_kit.openai_protocol import ChatMessageBody, ImageRef, message_parts
from forge_model_server.entrypoints.safe_fetch import FetchError, IPNetwork, fetch_public
from forge_model_server.service import ChatMessage, ImageInput


@dataclass(frozen=True)
class ImagePolicy:
    """What the server takes as images (settings ``IMAGE_*``; see ``config.py``)."""

    max_bytes: int = MAX_IMAGE_BYTES
    max_images: int = 8
    fetch_urls: bool = False
    url_timeout_s: float = 10.0
    allowed_networks: tuple[IPNetwork, ...] = ()


async def _image(ref: ImageRef, policy: ImagePolicy) -> ImageInput:
    try:
        if ref.url[:5].lower() == "data:":
            data = decode_data_uri(ref.url, max_bytes=policy.max_bytes)
        elif not policy.fetch_urls:
            raise errors.ValidationError(
                ref.param, "image URLs are not fetched by this server; send the image as a data: URI"
            )
        else:
            data = await fetch_public(
                ref.url,
                max_bytes=policy.max_bytes,
                timeout_s=policy.url_timeout_s,
                allowed_networks=policy.allowed_networks,
            )
    except (ImageError, FetchError) as exc:
        raise errors.ValidationError(ref.param, f"the image {exc}") from None
    digest = ImageBytes.of(data)
    return ImageInput(ref.param, digest.data, digest.sha256)


async def chat_messages(bodies: list[ChatMessageBody], policy: ImagePolicy) -> list[ChatMessage]:
    """The messages with their images read (at most ``policy.max_images`` in one request)."""
    messages: list[ChatMessage] = []
    count = 0
    for i, body in enumerate(bodies):
        parts = message_parts(body, i)
        if not any(isinstance(p, ImageRef) for p in parts):
            messages.append(ChatMessage(body.role, "\n".join(p for p in parts if isinstance(p, str))))
            continue
        read: list[str | ImageInput] = []
        for part in parts:
            if isinstance(part, str):
                read.append(part)
                continue
            count += 1
            if count > policy.max_images:
                raise errors.ValidationError(part.param, f"at most {policy.max_images} images per request")
            read.append(await _image(part, policy))
        text = "\n".join(p for p in read if isinstance(p, str))
        messages.append(ChatMessage(body.role, text, tuple(read)))
    return messages
