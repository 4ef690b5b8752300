"""An engine's refusal in one shape, whichever engine answered.

Forge's model server and vLLM refuse the same requests, but not in the same words: vLLM's error
body has ``type`` ``BadRequestError``, an integer ``code`` (the status again) and, for some
refusals, no ``param``; Forge's has an OpenAI ``type``, a string ``code`` and names the field.
A client of the gateway must not learn which engine served it from an error, so every 4xx an
engine answers is rewritten here into the OpenAI shape Forge's engine gives (the message kept):

- ``type``: an OpenAI error type, from the status when the engine's is not one;
- ``code``: a string, from the status when the engine's is not one (``model_not_found`` for a
  404 naming the model, as OpenAI and Forge say it);
- ``param``: the engine's when it names one, else the field the refusal is about, read from the
  message vLLM gives for it (a token id out of the vocabulary: ``prompt``; an image for a model
  that reads none: the first image part, ``messages.0.content.1``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

#: OpenAI's error types; anything else an engine says is replaced.
OPENAI_TYPES = frozenset(
    {
        "invalid_request_error",
        "authentication_error",
        "permission_error",
        "not_found_error",
        "rate_limit_error",
        "server_error",
    }
)
_TYPE_BY_STATUS = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
_CODE_BY_STATUS = {400: "invalid_value", 401: "invalid_api_key", 403: "permission_denied", 404: "not_found",
                   413: "request_too_large", 422: "invalid_value", 429: "rate_limit_exceeded"}  # fmt: skip
_MAX_MESSAGE = 2000


def _first_image(body: dict[str, object]) -> str | None:
    messages = body.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and part.get("type") == "image_url":
                return f"messages.{i}.content.{j}"
    return None


#: What vLLM's message says → the field it is about (None: the rule does not apply to this body).
_PARAM_RULES: list[tuple[re.Pattern[str], Callable[[dict[str, object]], str | None]]] = [
    (
        re.compile(r"[Tt]oken id -?\d+ is out of vocabulary"),
        lambda body: "prompt" if "prompt" in body else None,
    ),
    (re.compile(r"is not a multimodal model"), _first_image),
]


def conform_error(status: int, content: bytes, body: dict[str, object]) -> bytes:
    """The engine's 4xx error ``content`` for the request ``body``, in the shape above."""
    try:
        parsed = json.loads(content)
    except ValueError:
        parsed = None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if not isinstance(error, dict):
        text = content.decode(errors="replace").strip()
        error = {"message": text or f"the model server refused the request ({status})"}
    message = str(error.get("message") or f"the model server refused the request ({status})")[:_MAX_MESSAGE]
    param = error.get("param")
    if not isinstance(param, str) or not param:
        param = next((infer(body) for pattern, infer in _PARAM_RULES if pattern.search(message)), None)
    type_ = error.get("type")
    if type_ not in OPENAI_TYPES:
        type_ = _TYPE_BY_STATUS.get(status, "invalid_request_error")
    code = error.get("code")
    if not isinstance(code, str) or not code:
        code = "model_not_found" if status == 404 and param == "model" else _CODE_BY_STATUS.get(status)
    return json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}).encode()
