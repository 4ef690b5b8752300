"""The response cache: answers to deterministic requests, replayed without going upstream.

A request is deterministic when it asks for greedy decoding (``temperature`` 0) or fixes a
``seed``: the same model version then gives the same answer. The key hashes the tenant, the
resolved model version (so a canary and its stable model never share entries, and a promotion
starts afresh) and the whole request as sent upstream, JSON-normalised (sorted keys). Entries are
never shared across tenants. Values live in the kit's :class:`~forge_kit.cache.Cache` (Redis when
configured, so every gateway replica shares them; in process otherwise) with a TTL.

Only complete answers are stored: a 200 body, or a stream that ended with ``[DONE]`` and carried
no error event; a stream is replayed as the bytes it was relayed as.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client import Counter

from forge_kit.cache import Cache

CACHE_LOOKUPS = Counter("forge_gateway_response_cache_total", "Response-cache lookups and stores", ["result"])
#: Response header saying whether the answer came from the cache (``hit``) or was stored (``miss``).
CACHE_HEADER = "x-forge-cache"
_SSE_DONE = b"data: [DONE]"


def is_deterministic(body: Mapping[str, object]) -> bool:
    """Greedy (``temperature`` 0) or seeded: the same version gives the same answer."""
    temperature = body.get("temperature")
    seed = body.get("seed")
    greedy = isinstance(temperature, int | float) and not isinstance(temperature, bool) and temperature == 0
    seeded = isinstance(seed, int) and not isinstance(seed, bool)
    return greedy or seeded


def cache_key(tenant_id: str, path: str, body: Mapping[str, object]) -> str:
    """The key of ``body`` (already rewritten to the resolved model version) for ``tenant_id``."""
    normalized = json.dumps(
        {"tenant": tenant_id, "path": path, "request": body}, sort_keys=True, separators=(",", ":")
    )
    return "resp:" + hashlib.sha256(normalized.encode()).hexdigest()


def complete_stream(data: bytes) -> bool:
    """A relayed SSE stream that finished normally: ends with ``[DONE]``, no error event in it."""
    return data.rstrip().endswith(_SSE_DONE) and b'data: {"error"' not in data


@dataclass(frozen=True)
class CachedResponse:
    content_type: str
    content: bytes


class ResponseCache:
    """Stores and finds responses; ``ttl_s`` bounds staleness, ``max_bytes`` the size of one entry."""

    def __init__(self, cache: Cache, ttl_s: float = 300.0, max_bytes: int = 1 << 20) -> None:
        self._cache = cache
        self._ttl_s = ttl_s
        self.max_bytes = max_bytes

    async def get(self, key: str) -> CachedResponse | None:
        raw = await self._cache.get(key)
        if raw is None:
            CACHE_LOOKUPS.labels("miss").inc()
            return None
        content_type, _, content = raw.partition(b"\n")
        CACHE_LOOKUPS.labels("hit").inc()
        return CachedResponse(content_type.decode(), content)

    async def put(self, key: str, content_type: str, content: bytes) -> bool:
        """Store ``content`` unless it is too large; whether it was stored."""
        if len(content) > self.max_bytes or "\n" in content_type:
            return False
        await self._cache.set(key, content_type.encode() + b"\n" + content, self._ttl_s)
        CACHE_LOOKUPS.labels("store").inc()
        return True
