"""Errors in the OpenAI API's format, for every service that speaks that protocol (the model
server, as vLLM does, and the gateway in front of it): ``{"error": {"message", "type", "param",
"code"}}`` with the status codes OpenAI clients expect, mapped from the kit's domain errors."""

from __future__ import annotations

import math
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from forge_kit import errors
from forge_kit.limits import OPENAI_ERRORS_STATE


def openai_error(
    status: int,
    message: str,
    *,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """An error in the OpenAI format."""
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def error_path(body: object, loc: Sequence[int | str], *, missing: bool = False) -> str:
    """The dotted path of a validation error's location in the request body, without the tags
    pydantic adds for the member of a union it tried (``prompt.str`` → ``prompt``): an element
    counts where the body has it, or, for a ``missing`` field, as the last element."""
    parts: list[str] = []
    at = body
    for i, key in enumerate(loc):
        if isinstance(at, dict) and isinstance(key, str) and (key in at or (missing and i == len(loc) - 1)):
            parts.append(key)
            at = at.get(key)
        elif isinstance(at, list) and isinstance(key, int) and 0 <= key < len(at):
            parts.append(str(key))
            at = at[key]
    return ".".join(parts) or "body"


def install_openai_error_handlers(app: FastAPI) -> None:
    """Map validation (400 naming the field; ``unsupported_parameter`` for a field the server cannot
    honour), the framework's own 404/405/413, not found (404), conflicts (409), missing
    credentials (401) and overload (429 with Retry-After) to OpenAI errors; anything unexpected
    becomes a 500 without internals. Services add their own handlers for their own errors.
    The body-size limit of :class:`forge_kit.http.HttpServer` answers this app in the same format."""
    setattr(app.state, OPENAI_ERRORS_STATE, True)

    @app.exception_handler(errors.ValidationError)
    async def _invalid(_: Request, exc: errors.ValidationError) -> JSONResponse:
        code = (
            "unsupported_parameter" if isinstance(exc, errors.UnsupportedParameterError) else "invalid_value"
        )
        return openai_error(400, exc.message, param=exc.field, code=code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # The framework's own refusals (no such route, method not allowed, body too large).
        codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
        message = exc.detail if isinstance(exc.detail, str) else "request refused"
        headers = dict(exc.headers) if exc.headers else None
        return openai_error(exc.status_code, message, code=codes.get(exc.status_code), headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _malformed(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = list(first.get("loc", ()))
        if loc[:1] == ["body"]:
            field = error_path(exc.body, loc[1:], missing=first.get("type") == "missing")
        else:  # a query, path or header parameter: named as FastAPI locates it
            field = ".".join(str(p) for p in loc) or "body"
        return openai_error(400, f"{field}: {first.get('msg')}", param=field, code="invalid_value")

    @app.exception_handler(errors.NotFoundError)
    async def _missing(_: Request, exc: errors.NotFoundError) -> JSONResponse:
        return openai_error(404, exc.message, code="not_found")

    @app.exception_handler(errors.AlreadyExistsError)
    async def _exists(_: Request, exc: errors.AlreadyExistsError) -> JSONResponse:
        return openai_error(409, exc.message, code="already_exists")

    @app.exception_handler(errors.ConflictError)
    async def _conflict(_: Request, exc: errors.ConflictError) -> JSONResponse:
        return openai_error(409, exc.message, code="failed_precondition")

    @app.exception_handler(errors.UnauthenticatedError)
    async def _unauthenticated(_: Request, exc: errors.UnauthenticatedError) -> JSONResponse:
        return openai_error(
            401,
            exc.message,
            type_="authentication_error",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )

    @app.exception_handler(errors.PermissionDeniedError)
    async def _denied(_: Request, exc: errors.PermissionDeniedError) -> JSONResponse:
        return openai_error(403, exc.message, type_="permission_error", code="permission_denied")

    @app.exception_handler(errors.OverloadedError)
    async def _overloaded(_: Request, exc: errors.OverloadedError) -> JSONResponse:
        retry = str(max(1, math.ceil(exc.retry_after_s)))
        return openai_error(
            429,
            exc.message,
            type_="rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": retry},
        )

    @app.exception_handler(errors.UnavailableError)
    async def _unavailable(_: Request, exc: errors.UnavailableError) -> JSONResponse:
        retry = str(max(1, math.ceil(exc.retry_after_s)))
        return openai_error(
            503, exc.message, type_="server_error", code="service_unavailable", headers={"Retry-After": retry}
        )

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        return openai_error(500, "internal error", type_="server_error")
