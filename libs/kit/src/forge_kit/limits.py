"""A request-body size limit for every Forge HTTP server (ASGI middleware).

A body announced larger than the limit (``Content-Length``) is refused before any of it reaches the
app; a body without a length (``Transfer-Encoding: chunked``) is read up to the limit and refused as
soon as it passes it. Before answering, what is left of a refused body is read and dropped for a
bounded time and size (nginx's lingering close): a client still sending then reads the 413 instead
of a connection reset. A JSON body (a JSON content type, or none) that nests arrays and objects
deeper than :data:`forge_kit.validate.MAX_JSON_DEPTH` is answered 400 naming the limit before any
parser sees it. Refused means 413 (400) with a JSON error: the OpenAI format on servers that speak that
protocol (:func:`forge_kit.openai_errors.install_openai_error_handlers` marks them), the kit's own
``{"error": {"code", "message"}}`` elsewhere.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from forge_kit.validate import json_depth_error

#: gRPC's own default receive limit, set explicitly so each service can size it
#: (settings: ``grpc_max_receive_bytes``).
DEFAULT_MAX_MESSAGE_BYTES = 4 << 20
#: The longest query, in characters, anywhere on the RAG path: the retriever's Search, the
#: reranker's Rerank and the gateway's ``/v1/rag/query`` and vector-store search all default to it
#: (settings ``max_query_chars`` / ``rag_max_query_chars``). Whole documents are queries in some
#: retrieval tasks (find the counter-argument); the dense side embeds only the first
#: ``max_dense_query_chars`` of one, the cross-encoder reads what fits its window, and the gateway
#: refuses a question its model's context cannot hold (400 naming ``max_context_tokens``).
RAG_MAX_QUERY_CHARS = 65_536
#: The default most bytes of one request body (settings: ``http_max_body_bytes``).
DEFAULT_MAX_BODY_BYTES = 1 << 20
#: The default of the OpenAI-compatible servers: a long chat's prompt fits (the model server takes
#: twice as much, so whatever the gateway admits still fits once re-encoded upstream).
OPENAI_MAX_BODY_BYTES = 4 << 20
#: How long, and how much past the limit, a refused body is read and dropped before the answer.
DRAIN_S = 5.0
DRAIN_MIN_BYTES = 32 << 20
#: ``app.state`` attribute that selects the OpenAI error format for the 413 answer.
OPENAI_ERRORS_STATE = "openai_errors"


class _TooLarge(Exception):
    pass


class BodySizeLimit:
    """Wraps ``app``; requests whose body passes ``max_bytes`` get 413 and never reach it."""

    def __init__(self, app: ASGIApp, max_bytes: int, *, state_of: Any = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self._drain_bytes = max(4 * max_bytes, DRAIN_MIN_BYTES)
        # The FastAPI app whose state says which error format to answer with (may be ``app``).
        self._state_of = state_of if state_of is not None else app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None and length > self.max_bytes:
            if length <= self._drain_bytes:
                await self._drain(receive, 0)
            await self._refuse(send)
            return
        json_like = _may_be_json(scope)
        if length is not None and not json_like:
            await self.app(scope, receive, send)
            return
        # Read the whole body (it is at most max_bytes) and replay it to the app: a body without
        # a length is counted as it comes; a JSON body is checked for its nesting first.
        try:
            messages = await self._read_bounded(receive)
        except _TooLarge:
            await self._drain(receive, self.max_bytes)
            await self._refuse(send)
            return
        if json_like:
            why = json_depth_error(
                b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request")
            )
            if why:
                await self._answer(send, 400, "invalid_argument", why)
                return
        replay = iter(messages)

        async def replayed() -> Message:
            message = next(replay, None)
            return message if message is not None else await receive()

        await self.app(scope, replayed, send)

    async def _read_bounded(self, receive: Receive) -> list[Message]:
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return messages
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                raise _TooLarge
            if not message.get("more_body", False):
                return messages

    async def _drain(self, receive: Receive, drained: int) -> None:
        """Read and drop the rest of a refused body, up to ``_drain_bytes`` in all and ``DRAIN_S``."""
        try:
            async with asyncio.timeout(DRAIN_S):
                while drained <= self._drain_bytes:
                    message = await receive()
                    if message["type"] != "http.request" or not message.get("more_body", False):
                        return
                    drained += len(message.get("body", b""))
        except TimeoutError:
            return

    async def _refuse(self, send: Send) -> None:
        message = f"request body is larger than this server's limit of {self.max_bytes} bytes"
        await self._answer(send, 413, "request_too_large", message)

    async def _answer(self, send: Send, status: int, code: str, message: str) -> None:
        state = getattr(self._state_of, "state", None)
        error: dict[str, object]
        if getattr(state, OPENAI_ERRORS_STATE, False):
            error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
        else:
            error = {"code": code, "message": message}
        body = json.dumps({"error": error}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _may_be_json(scope: Scope) -> bool:
    """Whether an app may parse the body as JSON: a JSON content type, or none at all."""
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            return b"json" in value.lower()
    return scope.get("method", "GET") not in ("GET", "HEAD")


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
