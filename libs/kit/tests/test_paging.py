"""Page tokens: what decode_page accepts and what it refuses by field."""

from __future__ import annotations

import base64

import pytest
from forge.common.v1 import common_pb2

from forge_kit import errors
from forge_kit.paging import MAX_OFFSET, decode_page, page_info


def token(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode()


def test_a_token_from_page_info_reads_back_as_its_offset() -> None:
    info = page_info(20, 10, 100)
    assert decode_page(common_pb2.PageRequest(page_size=10, page_token=info.next_page_token)) == (10, 30)
    assert decode_page(common_pb2.PageRequest()) == (50, 0)


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (common_pb2.PageRequest(page_size=501), "page.page_size"),
        (common_pb2.PageRequest(page_token="not base64 at all!"), "page.page_token"),
        (common_pb2.PageRequest(page_token=token("o:-1")), "page.page_token"),
        # Past a database's 64-bit OFFSET: refused, not an internal error from the query.
        (common_pb2.PageRequest(page_token=token(f"o:{2**63}")), "page.page_token"),
        (common_pb2.PageRequest(page_token=token(f"o:{MAX_OFFSET + 1}")), "page.page_token"),
    ],
)
def test_bad_pages_are_refused_naming_the_field(request_: common_pb2.PageRequest, field: str) -> None:
    with pytest.raises(errors.ValidationError) as caught:
        decode_page(request_)
    assert caught.value.field == field
