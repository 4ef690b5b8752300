"""Model endpoints a run may query, each with the credential issued for it.

A credential is bound to its endpoint: the gateway's key (``INFERENCE_GATEWAY_TOKEN``) travels only
to ``INFERENCE_GATEWAY_URL``, each ``MODEL_ENDPOINTS`` entry's token only to that entry's URL, and
a model server eval starts for a run gets that server's own random token. Any other address is
*unregistered*: only an admin may point a run at it, and the run then carries no credential at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import urlsplit

from forge_kit import errors


def normalize_endpoint(url: str, field: str = "endpoint") -> str:
    """``scheme://host[:port][/path]`` lower-cased where case does not matter, without a trailing
    slash; a URL with credentials, a query or a fragment is refused (they would change where a
    request lands or what it carries)."""
    text = url.strip()
    try:
        parsed = urlsplit(text)
        port = parsed.port
    except ValueError as exc:
        raise errors.ValidationError(field, f"is not a URL: {text[:200]!r} ({exc})") from None
    if parsed.scheme.lower() not in ("http", "https") or not parsed.hostname:
        raise errors.ValidationError(field, "must be an http:// or https:// URL")
    if parsed.username is not None or parsed.password is not None or parsed.query or parsed.fragment:
        raise errors.ValidationError(field, "must not carry credentials, a query or a fragment")
    if any(c.isspace() or ord(c) < 32 for c in text) or len(text) > 2048:
        raise errors.ValidationError(field, "must be at most 2048 characters without spaces")
    if any(part in (".", "..") for part in parsed.path.split("/")):
        raise errors.ValidationError(field, "must not contain '.' or '..' path segments")
    host = parsed.hostname.lower()
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    netloc = host if port is None else f"{host}:{port}"
    return f"{parsed.scheme.lower()}://{netloc}{parsed.path.rstrip('/')}"


class EndpointRegistry:
    """The registered endpoints (normalised base URL → bearer token, empty for none)."""

    def __init__(self, credentials: Mapping[str, str] | None = None) -> None:
        self._credentials: dict[str, str] = {}
        for url, token in (credentials or {}).items():
            if url:
                self._credentials[normalize_endpoint(url, "model_endpoints")] = token

    def is_registered(self, url: str) -> bool:
        return normalize_endpoint(url) in self._credentials

    def credential(self, url: str) -> str:
        """The token issued for ``url``; empty for an unregistered one (nothing is sent there)."""
        try:
            return self._credentials.get(normalize_endpoint(url), "")
        except errors.ValidationError:
            return ""

    def urls(self) -> list[str]:
        return sorted(self._credentials)
