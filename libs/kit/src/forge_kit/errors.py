"""Domain errors that every transport maps to one status code.

Services raise these from ``service.py``; the gRPC interceptor and the HTTP exception handlers in
this package translate them, so a route never builds a status code by hand.
"""

from __future__ import annotations

import errno

STORAGE_FULL_MESSAGE = "storage is full: the request was not recorded; retry once space is freed"
_SQLITE_FULL = 13  # sqlite3.SQLITE_FULL: "database or disk is full"
_POSTGRES_DISK_FULL = "53100"  # SQLSTATE disk_full


class ForgeError(Exception):
    """Base class of errors a caller can act on."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ValidationError(ForgeError):
    """The request is malformed; ``field`` names the offending field (dotted path)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class UnsupportedParameterError(ValidationError):
    """The request asks for something this server cannot do (``field`` names it); refused rather
    than silently ignored."""


class NotFoundError(ForgeError):
    """The named resource does not exist."""


class AlreadyExistsError(ForgeError):
    """A resource with the same identity already exists."""


class ConflictError(ForgeError):
    """The request is valid but the resource's current state does not allow it."""


class OverloadedError(ForgeError):
    """A bounded queue or rate limit is full; ``retry_after_s`` tells when to try again."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class UnavailableError(ForgeError):
    """A system this one depends on did not answer in time (e.g. Temporal under load); nothing was
    changed, and the same request may be sent again; ``retry_after_s`` suggests when."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class UnauthenticatedError(ForgeError):
    """The caller presented no valid credentials."""


class PermissionDeniedError(ForgeError):
    """The caller is authenticated but may not do this (another team's job, an admin action)."""


def storage_full(exc: BaseException) -> bool:
    """Whether ``exc``, or an error it was raised from, says the disk is full: ``ENOSPC`` or
    ``EDQUOT`` from the OS, ``SQLITE_FULL`` from SQLite, ``disk_full`` (53100) from PostgreSQL
    (through SQLAlchemy's wrapper or not). Transports answer these with a clear "storage is
    full" (HTTP 507, gRPC ``RESOURCE_EXHAUSTED``) instead of a bare internal error."""
    seen: set[int] = set()
    found: BaseException | None = exc
    while found is not None and id(found) not in seen:
        seen.add(id(found))
        if isinstance(found, OSError) and found.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if getattr(found, "sqlite_errorcode", None) == _SQLITE_FULL:
            return True
        if getattr(found, "sqlstate", None) == _POSTGRES_DISK_FULL:
            return True
        orig = getattr(found, "orig", None)  # SQLAlchemy's DBAPIError wraps the driver's error
        found = (
            orig
            if isinstance(orig, BaseException) and id(orig) not in seen
            else (found.__cause__ or found.__context__)
        )
    return False
