"""The local platform's secrets store, ``var/secrets/`` (directory 0700, files 0600).

- ``tokens.json``: per-service bearer tokens. Each service gets its own random token and only its
  callers learn it, so a token leaked from one service's environment does not open every other.
- ``event_keys.json``: per-service Ed25519 event signing keys (:mod:`forge_kit.eventauth`); a
  service holds only its own private key, every consumer the public keys.
- ``generated.json``: other secrets a service's settings need (``<service>.<SETTING>``), such as
  the gateway's bootstrap API key — nothing has a built-in default.

Every file is created once and then only grows (a new name gets a value; existing ones never
change), so restarting one service never breaks the callers still running with the old value.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from forge_cli.platform import ServiceSpec, generated_name
from forge_kit.eventauth import EventSigner

TOKEN_BYTES = 32


def new_token() -> str:
    """A random bearer token or API key (256 bits, URL-safe)."""
    return secrets.token_urlsafe(TOKEN_BYTES)


def new_event_key() -> str:
    """A fresh Ed25519 event signing key as settings hold it."""
    return EventSigner.generate("forge").secret()


def load_or_create(
    path: Path, services: Iterable[str], make: Callable[[], str] = new_token
) -> dict[str, str]:
    """Values for ``services``, read from ``path``; missing ones are made and saved (mode 0600)."""
    tokens: dict[str, str] = {}
    if path.exists():
        loaded = json.loads(path.read_text())
        if not isinstance(loaded, dict) or not all(isinstance(v, str) for v in loaded.values()):
            raise ValueError(f"{path} is not a JSON object of name to secret")
        tokens = dict(loaded)
    missing = [name for name in services if name not in tokens]
    for name in missing:
        tokens[name] = make()
    if missing or not path.exists():
        _write_private(path, tokens)
    elif path.stat().st_mode & 0o077:
        path.chmod(0o600)
    return tokens


@dataclass(frozen=True)
class PlatformSecrets:
    """Everything secret ``forge up`` hands the services, and what was generated just now."""

    tokens: dict[str, str]
    event_keys: dict[str, str]
    generated: dict[str, str]
    new: dict[str, str]
    """Generated secrets created by this call (``<service>.<SETTING>``): named (never printed), then only in
    the secrets store."""


def load_platform(
    tokens_path: Path, event_keys_path: Path, generated_path: Path, table: Iterable[ServiceSpec]
) -> PlatformSecrets:
    """Every secret of ``table``'s services, created where missing."""
    rows = list(table)
    wanted = [generated_name(s, setting) for s in rows for setting in s.generated]
    before = set(json.loads(generated_path.read_text())) if generated_path.exists() else set()
    generated = load_or_create(generated_path, wanted)
    return PlatformSecrets(
        tokens=load_or_create(tokens_path, [s.name for s in rows]),
        event_keys=load_or_create(event_keys_path, sorted({s.service for s in rows}), new_event_key),
        generated=generated,
        new={name: generated[name] for name in wanted if name not in before},
    )


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
