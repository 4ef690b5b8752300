"""Client of one model-server replica over its OpenAI-compatible HTTP API.

The upstream may be Forge's ``model_server`` or ``vllm serve``: the same protocol, so nothing here
is specific to either. Every call carries what is left of the caller's deadline as its timeout;
closing a stream closes the connection, which is how a cancelled request is cancelled upstream.

aiohttp rather than httpx on this leg: the gateway relays every token of every stream, and at 50
concurrent streams httpcore's pool bookkeeping (a scan of all connections, with a readability
poll of each, on every request start and end) cost about 40% of the gateway's CPU (py-spy,
``load/inference/RESULTS.md``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import aiohttp
import structlog

from forge_kit import errors

log = structlog.get_logger(__name__)

#: What a broken upstream connection raises mid-stream (after the status line).
StreamBroken = aiohttp.ClientError


class UpstreamUnavailableError(errors.ForgeError):
    """The model server cannot be reached or says it is unavailable; try again after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class UpstreamError(errors.ForgeError):
    """The model server failed the request (a 5xx, or it rejected the gateway's credentials)."""


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline exceeded before the model server was called")
    return left


def error_message(body: bytes) -> tuple[str, str | None]:
    """``(message, param)`` of an OpenAI error body, or the raw text when it is not one."""
    try:
        error = json.loads(body).get("error", {})
        return str(error.get("message") or body.decode(errors="replace")), error.get("param")
    except (ValueError, AttributeError):
        return body.decode(errors="replace")[:500], None


def error_for(status: int, body: bytes, retry_after: str | None = None) -> errors.ForgeError:
    """The domain error an upstream error response stands for (used where bodies cannot pass through)."""
    message, param = error_message(body)
    if status in (400, 422):
        return errors.ValidationError(param or "request", message)
    if status == 404:
        return errors.NotFoundError(message)
    if status == 429:
        return errors.OverloadedError(message, float(retry_after or 1))
    if status == 503:
        return UpstreamUnavailableError(f"model server unavailable: {message}", float(retry_after or 1))
    if status in (401, 403):
        return UpstreamError(f"model server rejected the gateway's credentials ({status})")
    # A 5xx body may hold the upstream's internals (a trace); it goes to the log, not to callers.
    log.warning("upstream.error", status=status, body=message[:2000])
    return UpstreamError(f"model server error ({status})")


@dataclass(frozen=True)
class Reply:
    """A whole upstream answer. ``headers`` keys are lower-case."""

    status_code: int
    headers: Mapping[str, str]
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")

    def json(self) -> object:
        return json.loads(self.content)


class StreamReply:
    """An upstream answer whose status and headers are known and whose body is still to come."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status_code = response.status
        self.headers: Mapping[str, str] = {k.lower(): v for k, v in response.headers.items()}

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body as it arrives, one network read at a time."""
        async for chunk in self._response.content.iter_any():
            yield chunk

    async def aread(self) -> bytes:
        return await self._response.read()

    async def aclose(self) -> None:
        # Closing a response that has not been read to the end drops its connection: the
        # model server sees the disconnect and cancels the request.
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()


class ModelServerClient:
    """One upstream replica, its own connection pool, the gateway's bearer token."""

    def __init__(self, base_url: str, token: str | None) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        # Created on first use, inside the event loop that will use it.
        if self._session is None or self._session.closed:
            # No connection cap here: the gateway's admission limits are the ones that mean something.
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
            self._session = aiohttp.ClientSession(
                base_url=self.base_url + "/", headers=self._headers, connector=connector
            )
        return self._session

    def _unavailable(self, exc: BaseException) -> UpstreamUnavailableError:
        return UpstreamUnavailableError(f"model server at {self.base_url} unreachable: {type(exc).__name__}")

    async def _send(
        self, method: str, path: str, timeout: aiohttp.ClientTimeout, body: object
    ) -> aiohttp.ClientResponse:
        data = None if body is None else json.dumps(body).encode()
        headers = None if body is None else {"Content-Type": "application/json"}
        try:
            return await self._client().request(
                method, path.lstrip("/"), data=data, headers=headers, timeout=timeout
            )
        except TimeoutError as exc:
            raise TimeoutError("deadline exceeded waiting for the model server") from exc
        except (aiohttp.ClientConnectionError, OSError) as exc:
            raise self._unavailable(exc) from exc

    async def request(self, method: str, path: str, deadline: float, body: object = None) -> Reply:
        """One non-streaming call; the answer is returned whatever its status."""
        timeout = aiohttp.ClientTimeout(total=_remaining(deadline))
        response = await self._send(method, path, timeout, body)
        try:
            content = await response.read()
        except TimeoutError as exc:
            raise TimeoutError("deadline exceeded waiting for the model server") from exc
        except aiohttp.ClientError as exc:
            raise self._unavailable(exc) from exc
        finally:
            response.release()
        return Reply(response.status, {k.lower(): v for k, v in response.headers.items()}, content)

    async def open_stream(self, path: str, body: object, deadline: float) -> StreamReply:
        """Start a streaming call (the deadline bounds the whole stream); the caller closes it."""
        timeout = aiohttp.ClientTimeout(total=_remaining(deadline))
        return StreamReply(await self._send("POST", path, timeout, body))

    async def probe(self, path: str, timeout_s: float) -> Reply:
        """A GET of the replica's own state (``/metrics``, ``/v1/models``) with its own short timeout;
        any failure to get an answer is :class:`UpstreamUnavailableError`."""
        try:
            return await self.request("GET", path, time.monotonic() + timeout_s)
        except TimeoutError as exc:
            raise UpstreamUnavailableError(f"model server at {self.base_url} timed out on {path}") from exc

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            # aiohttp's connections finish closing on the next loop turn.
            await asyncio.sleep(0)


def not_served_body(requested: str) -> bytes:
    """The OpenAI-format 404 body for an alias whose model version no replica serves: it names
    what the caller sent, not the registry's identity behind it."""
    message = (
        f"the model `{requested}` is not served right now: no model-server replica serves the "
        "version it names (GET /v1/models lists the models and aliases you can use)"
    )
    error = {"message": message, "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    return json.dumps({"error": error}).encode()
