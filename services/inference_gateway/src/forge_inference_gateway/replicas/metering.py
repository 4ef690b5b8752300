"""Tokens the replicas report in their answers' ``usage``, counted per model version.

``forge_gateway_tokens_total{model, kind}``: ``prompt`` (images' placeholder positions included, as
``prompt_tokens`` counts them), ``completion``, and ``image`` (of the prompt tokens, those images
filled: the model server's ``usage.prompt_tokens_details.image_tokens``). Read from the end of a
whole answer or of a stream (its last event before ``[DONE]`` carries the usage when the client
asked for it), without parsing the rest; an answer without usage counts nothing.
"""

from __future__ import annotations

import re

from prometheus_client import Counter

TOKENS = Counter(
    "forge_gateway_tokens_total",
    "Tokens the replicas reported in usage, by model version and kind (prompt, completion, image)",
    ["model", "kind"],
)
#: Bytes at the end of a stream kept to read its usage from.
TAIL_BYTES = 2048
_FIELDS = re.compile(rb'"(prompt_tokens|completion_tokens|image_tokens)"\s*:\s*(\d+)')
_KINDS = {b"prompt_tokens": "prompt", b"completion_tokens": "completion", b"image_tokens": "image"}


def usage_of(content: bytes) -> dict[str, int]:
    """The token counts of the last ``usage`` object in ``content`` (kind → tokens)."""
    at = content.rfind(b'"usage"')
    if at < 0:
        return {}
    return {_KINDS[name]: int(value) for name, value in _FIELDS.findall(content[at : at + 512])}


def meter(model: str, content: bytes) -> dict[str, int]:
    """Count the usage reported in ``content`` (a whole answer or a stream's tail) for ``model``."""
    usage = usage_of(content)
    for kind, tokens in usage.items():
        TOKENS.labels(model, kind).inc(tokens)
    return usage
