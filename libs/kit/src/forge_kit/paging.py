"""Offset paging behind opaque page tokens, shared by every List RPC."""

from __future__ import annotations

import base64

from forge.common.v1 import common_pb2

from forge_kit import errors

#: Largest offset a page may start at: beyond it a database's 64-bit OFFSET would overflow (an
#: internal error instead of an answer), and no listing here is that long.
MAX_OFFSET = 2**31 - 1


def decode_page(
    page: common_pb2.PageRequest, *, default_size: int = 50, max_size: int = 500
) -> tuple[int, int]:
    """(page_size, offset) of a request; an unreadable token is an INVALID_ARGUMENT on ``page.page_token``."""
    size = page.page_size or default_size
    if size > max_size:
        raise errors.ValidationError("page.page_size", f"must be at most {max_size}")
    if not page.page_token:
        return size, 0
    try:
        offset = int(base64.urlsafe_b64decode(page.page_token.encode()).decode().removeprefix("o:"))
    except (ValueError, UnicodeDecodeError):
        raise errors.ValidationError("page.page_token", "is not a token returned by this API") from None
    if not 0 <= offset <= MAX_OFFSET:
        raise errors.ValidationError("page.page_token", "is not a token returned by this API")
    return size, offset


def page_info(offset: int, returned: int, total: int) -> common_pb2.PageInfo:
    """The PageInfo of a page that starts at ``offset`` and holds ``returned`` items of ``total``."""
    following = offset + returned
    token = base64.urlsafe_b64encode(f"o:{following}".encode()).decode() if following < total else ""
    return common_pb2.PageInfo(next_page_token=token, total_size=total)
