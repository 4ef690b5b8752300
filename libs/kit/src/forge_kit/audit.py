"""The audit log of admin actions: who did what, when, and how it ended.

Every gRPC handler that calls :func:`forge_kit.grpckit.require_admin` is audited by the server
interceptor on its way out — allowed or denied, succeeded or failed — with no code in the
handler. HTTP admin routes call :func:`record` themselves. An entry is one JSON line appended
to ``<data_dir>/audit.jsonl`` (mode 0600 in a 0700 folder; flushed and fsynced before the reply leaves, so an acknowledged
admin action is never missing from the log) and also emitted on the service's log as event
``audit``. Values under secret-looking keys are redacted, never written.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import threading
from pathlib import Path
from typing import Any

import structlog

from forge_kit.logs import redact
from forge_kit.paths import private_dir, private_file

log = structlog.get_logger("forge.audit")

_path: Path | None = None
_lock = threading.Lock()

AUDIT_FILE = "audit.jsonl"


def configure(data_dir: str | os.PathLike[str]) -> Path:
    """Write audit entries under ``data_dir`` from now on; returns the file's path."""
    global _path
    _path = private_file(private_dir(data_dir) / AUDIT_FILE)
    return _path


def path() -> Path | None:
    return _path


def record(action: str, actor: str, outcome: str, **details: Any) -> dict[str, Any]:
    """Append one entry: ``action`` (what, e.g. ``SetQuota``), ``actor`` (the principal's name),
    ``outcome`` (``OK``, ``PERMISSION_DENIED``, another status name or an HTTP status)."""
    entry = {
        "at": dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds"),
        "action": action,
        "actor": actor,
        "outcome": outcome,
        **redact(details),
    }
    if _path is not None:
        line = json.dumps(entry, sort_keys=True, default=str) + "\n"
        with _lock, open(private_file(_path), "a", encoding="utf-8") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())
    log.info("audit", **entry)
    return entry


def read(limit: int | None = None) -> list[dict[str, Any]]:
    """The entries written so far (oldest first), the last ``limit`` if given."""
    if _path is None or not _path.exists():
        return []
    lines = _path.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in (lines[-limit:] if limit else lines) if line.strip()]
