"""Checks every service applies to what a caller sends: numbers in range (never NaN or infinity),
names fit for a header or a path, bounded strings and label maps, JSON without ``NaN`` literals.

Each check raises :class:`~forge_kit.errors.ValidationError` naming the field, so a transport
answers 400 / INVALID_ARGUMENT instead of failing later with a 500. The ``Annotated`` types are the
same rules for pydantic request models (FastAPI answers them with 400/422 naming the field).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Annotated

import numpy as np
from pydantic import Field, StringConstraints

from forge_kit import errors

#: The largest seed a request may carry: torch generators and vLLM take a signed 64-bit seed.
MAX_SEED = 2**63 - 1
#: Longest name (model, alias, …) a request may carry; it may end up in a header or a log line.
MAX_NAME_CHARS = 256
#: Longest filesystem path a request may name (Linux's PATH_MAX), and longest path component.
MAX_PATH_CHARS = 4096
MAX_PATH_COMPONENT_BYTES = 255
#: Default bounds of a label map (Kubernetes-like: 63-character keys; values a little longer).
MAX_LABELS = 64
MAX_LABEL_KEY_CHARS = 63
MAX_LABEL_VALUE_CHARS = 256
#: Longest URI a request may carry.
MAX_URI_CHARS = 2048

#: Visible ASCII only: no space, no control character (NUL, CR, LF), nothing a header cannot hold.
_NAME = re.compile(r"[!-~]+")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

#: A float that JSON ``NaN``/``Infinity`` cannot fill.
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
#: A sampling seed torch accepts.
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
#: A name that may reach a header, a metric label or a path: visible ASCII, at most 256 characters.
PrintableName = Annotated[
    str, StringConstraints(min_length=1, max_length=MAX_NAME_CHARS, pattern=r"^[!-~]+$")
]


def check_finite(
    field: str,
    value: object,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
) -> float:
    """``value`` when it is a finite number within ``[low, high]`` (``(low, high]`` with
    ``low_open``); ``ValidationError`` naming ``field`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise errors.ValidationError(field, "must be a number")
    if not math.isfinite(value):
        raise errors.ValidationError(field, f"must be a finite number, got {value}")
    if low is not None and (value <= low if low_open else value < low):
        raise errors.ValidationError(field, f"must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and value > high:
        raise errors.ValidationError(field, f"must be at most {high}, got {value}")
    return float(value)


def check_int(field: str, value: object, low: int, high: int) -> int:
    """``value`` when it is an integer (not a bool) within ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise errors.ValidationError(field, "must be an integer")
    if not low <= value <= high:
        raise errors.ValidationError(field, f"must be between {low} and {high}, got {value}")
    return value


def check_seed(field: str, value: object) -> int:
    return check_int(field, value, 0, MAX_SEED)


def check_printable_name(field: str, value: object, max_chars: int = MAX_NAME_CHARS) -> str:
    """A name safe to put in a header, a metric label or a log line: 1 to ``max_chars`` visible
    ASCII characters (no space, NUL, CR or LF)."""
    if not isinstance(value, str) or not value:
        raise errors.ValidationError(field, "is required and must be a string")
    if len(value) > max_chars:
        raise errors.ValidationError(field, f"must be at most {max_chars} characters, got {len(value)}")
    if not _NAME.fullmatch(value):
        raise errors.ValidationError(
            field, "must be visible ASCII characters only (no spaces or control characters)"
        )
    return value


def check_text(field: str, value: str, max_chars: int, *, required: bool = False) -> str:
    """A free-text string of at most ``max_chars`` characters without control characters."""
    if required and not value:
        raise errors.ValidationError(field, "is required")
    if len(value) > max_chars:
        raise errors.ValidationError(field, f"must be at most {max_chars} characters, got {len(value)}")
    if _CONTROL.search(value):
        raise errors.ValidationError(field, "must not contain control characters")
    return value


def check_path(field: str, value: str, max_chars: int = MAX_PATH_CHARS) -> str:
    """A filesystem path the OS can take: at most ``max_chars`` characters, no control character
    (NUL included), each component at most 255 bytes."""
    check_text(field, value, max_chars, required=True)
    for part in value.split("/"):
        if len(part.encode()) > MAX_PATH_COMPONENT_BYTES:
            raise errors.ValidationError(
                field, f"has a component longer than {MAX_PATH_COMPONENT_BYTES} bytes"
            )
    return value


def check_labels(
    field: str,
    labels: Mapping[str, str],
    *,
    max_count: int = MAX_LABELS,
    max_key_chars: int = MAX_LABEL_KEY_CHARS,
    max_value_chars: int = MAX_LABEL_VALUE_CHARS,
) -> Mapping[str, str]:
    """A label map of at most ``max_count`` entries: keys of 1 to ``max_key_chars`` visible ASCII
    characters, values of at most ``max_value_chars`` without control characters. A bad key is
    named by position, never echoed (the field name travels in gRPC metadata)."""
    if len(labels) > max_count:
        raise errors.ValidationError(field, f"must hold at most {max_count} labels, got {len(labels)}")
    for i, (key, value) in enumerate(labels.items()):
        if not key or len(key) > max_key_chars or not _NAME.fullmatch(key):
            raise errors.ValidationError(
                field, f"key #{i + 1} must be 1-{max_key_chars} visible ASCII characters (no spaces)"
            )
        check_text(f"{field}.{key}", value, max_value_chars)
    return labels


#: How deeply arrays and objects may nest in a JSON body (a deeper one is a 400): Python's parser
#: recurses per level, so a 100,000-level body would otherwise end in ``RecursionError``.
MAX_JSON_DEPTH = 64
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
#: Every byte but the four brackets (``bytes.translate`` deletes them).
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def json_depth_error(data: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> str:
    """Why ``data`` nests arrays and objects deeper than ``max_depth`` ("" when it does not),
    without parsing it: strings are dropped, and the running depth over the brackets left is
    summed with numpy (linear, C speed: tens of milliseconds for 4 MiB of brackets)."""
    raw = data.encode() if isinstance(data, str) else data
    if raw.count(b"[") + raw.count(b"{") <= max_depth:
        return ""
    brackets = np.frombuffer(_JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS), dtype=np.uint8)
    # "[" 0x5B and "{" 0x7B have bit 1 set, "]" 0x5D and "}" 0x7D do not: +1 / -1.
    steps = ((brackets >> 1) & 1).astype(np.int8) * 2 - 1
    if int(np.cumsum(steps, dtype=np.int32).max(initial=0)) <= max_depth:
        return ""
    return f"JSON nests arrays and objects deeper than {max_depth} levels"


def loads_json(data: bytes | str, field: str = "body", max_depth: int = MAX_JSON_DEPTH) -> object:
    """Parse JSON as the standard defines it: Python's ``json`` also takes ``NaN``, ``Infinity``
    and ``-Infinity``, which no other JSON parser does and no numeric field should receive.
    Arrays and objects nested deeper than ``max_depth`` are refused, naming the limit."""

    def no_constant(name: str) -> object:
        raise errors.ValidationError(field, f"is not standard JSON: {name} is not a number")

    too_deep = json_depth_error(data, max_depth)
    if too_deep:
        raise errors.ValidationError(field, too_deep)
    try:
        return json.loads(data, parse_constant=no_constant)
    except RecursionError:  # not reached after the check above; never a 500 regardless
        raise errors.ValidationError(
            field, f"JSON nests arrays and objects deeper than {max_depth} levels"
        ) from None
    except ValueError as exc:
        raise errors.ValidationError(field, f"malformed JSON: {exc}") from None
