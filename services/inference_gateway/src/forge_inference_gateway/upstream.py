"""Client of one upstream model server over its OpenAI-compatible HTTP API.

The upstream may be Forge's ``model_server`` or ``vllm serve``: the same protocol, so nothing here
is specific to either. Every call carries what is left of the caller's deadline as its timeout;
closing a stream closes the connection, which is how a cancelled request is cancelled upstream.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import structlog

from forge_kit import errors

log = structlog.get_logger(__name__)


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


class ModelServerClient:
    """One upstream replica; ``transport`` lets tests put an in-process app behind the same client."""

    def __init__(
        self, base_url: str, token: str | None, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.base_url = base_url.rstrip("/")
        self._client = httpx.AsyncClient(base_url=self.base_url, headers=headers, transport=transport)

    def _unavailable(self, exc: httpx.HTTPError) -> UpstreamUnavailableError:
        return UpstreamUnavailableError(f"model server at {self.base_url} unreachable: {type(exc).__name__}")

    async def request(self, method: str, path: str, deadline: float, body: object = None) -> httpx.Response:
        """One non-streaming call; the response is returned whatever its status."""
        try:
            return await self._client.request(method, path, json=body, timeout=_remaining(deadline))
        except httpx.TimeoutException as exc:
            raise TimeoutError("deadline exceeded waiting for the model server") from exc
        except httpx.TransportError as exc:
            raise self._unavailable(exc) from exc

    @asynccontextmanager
    async def stream(self, path: str, body: object, deadline: float) -> AsyncIterator[httpx.Response]:
        """A streaming call; the response's status is known on entry, its body not yet read."""
        request = self._client.build_request("POST", path, json=body, timeout=_remaining(deadline))
        try:
            response = await self._client.send(request, stream=True)
        except httpx.TimeoutException as exc:
            raise TimeoutError("deadline exceeded waiting for the model server") from exc
        except httpx.TransportError as exc:
            raise self._unavailable(exc) from exc
        try:
            yield response
        finally:
            await response.aclose()

    async def close(self) -> None:
        await self._client.aclose()
