"""Per-service bearer tokens for the local platform, kept in ``var/secrets/tokens.json``.

Each service gets its own random token and only its callers learn it, so a token leaked from one
service's environment does not open every other. The file is created once and then only grows
(a new service gets a token; existing ones never change), so restarting one service never breaks
the callers that are still running with the old value.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterable
from pathlib import Path

TOKEN_BYTES = 32


def load_or_create(path: Path, services: Iterable[str]) -> dict[str, str]:
    """Tokens for ``services``, read from ``path``; missing ones are generated and saved (mode 0600)."""
    tokens: dict[str, str] = {}
    if path.exists():
        loaded = json.loads(path.read_text())
        if not isinstance(loaded, dict) or not all(isinstance(v, str) for v in loaded.values()):
            raise ValueError(f"{path} is not a JSON object of service name to token")
        tokens = dict(loaded)
    missing = [name for name in services if name not in tokens]
    for name in missing:
        tokens[name] = secrets.token_urlsafe(TOKEN_BYTES)
    if missing or not path.exists():
        _write_private(path, tokens)
    elif path.stat().st_mode & 0o077:
        path.chmod(0o600)
    return tokens


def _write_private(path: Path, tokens: dict[str, str]) -> None:
    """Write atomically, never readable by others even for an instant."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.parent.chmod(0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump(tokens, handle, indent=2, sort_keys=True)
        handle.write("\n")
    os.replace(tmp, path)
