"""Domain errors that every transport maps to one status code.

Services raise these from ``service.py``; the gRPC interceptor and the HTTP exception handlers in
this package translate them, so a route never builds a status code by hand.
"""

from __future__ import annotations


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


class UnauthenticatedError(ForgeError):
    """The caller presented no valid credentials."""


class PermissionDeniedError(ForgeError):
    """The caller is authenticated but may not do this (another team's job, an admin action)."""
