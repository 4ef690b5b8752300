"""HTTP routes of the key lifecycle (:mod:`~forge_inference_gateway.keys.service`): the scope check every ``/v1`` route declares,
a tenant's own keys and their usage (``GET /v1/keys``), and the admin routes under
``/admin/v1/tenants/{name}/keys`` and ``…/audit`` (what ``forge tenants`` calls). Translation only.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from forge_inference_gateway.keys.service import MAX_LIFETIME_S, MAX_OVERLAP_S, SCOPES, ApiKeys, KeyView
from forge_kit import errors


def require_scope(scope: str) -> Callable[[Request], Awaitable[None]]:
    """Dependency of a ``/v1`` route: 403 unless the request's key has ``scope`` (after ``admit``)."""
    if scope not in SCOPES:
        raise ValueError(f"unknown scope {scope!r}")

    async def check(request: Request) -> None:
        grant = getattr(request.state, "key", None)
        if grant is None or scope not in grant.scopes:
            raise errors.PermissionDeniedError(f"this API key lacks the {scope!r} scope")

    return check


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=63)
    scopes: list[str] | None = Field(
        default=None, max_length=len(SCOPES), description=f"of {', '.join(SCOPES)}; all when omitted"
    )
    expires_in_s: float | None = Field(default=None, gt=0, le=MAX_LIFETIME_S)


class KeyRotate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    overlap_s: float = Field(default=3600.0, ge=0, le=MAX_OVERLAP_S)
    """How long the old key keeps working after the new one is issued."""


class KeyIssued(BaseModel):
    key: KeyView
    api_key: str
    """The secret, shown this once."""


class KeyList(BaseModel):
    object: str = "list"
    data: list[KeyView]


class AuditOut(BaseModel):
    events: list[dict[str, Any]]
    next_after: int


class KeyAdminRoutes:
    def __init__(self, keys: ApiKeys) -> None:
        self._keys = keys

    async def list_keys(self, name: str) -> dict[str, object]:
        return {"object": "list", "data": [asdict(k) for k in await self._keys.list_keys(name)]}

    async def create_key(self, name: str, body: KeyCreate) -> JSONResponse:
        view, secret = await self._keys.create(name, body.name, body.scopes, body.expires_in_s)
        return JSONResponse({"key": asdict(view), "api_key": secret}, status_code=201)

    async def rotate_key(self, name: str, key_id: str, body: KeyRotate) -> JSONResponse:
        view, secret = await self._keys.rotate(name, key_id, body.overlap_s)
        return JSONResponse({"key": asdict(view), "api_key": secret}, status_code=201)

    async def revoke_key(self, name: str, key_id: str) -> dict[str, object]:
        return asdict(await self._keys.revoke(name, key_id))

    async def audit(
        self,
        name: str,
        after: Annotated[int, Query(ge=0, le=2**62)] = 0,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> dict[str, object]:
        events = await self._keys.audit(name, after, limit)
        return {"events": events, "next_after": events[-1]["seq"] if events else after}


def install_key_api(app: FastAPI, keys: ApiKeys, tenant: Sequence[Any], admin: Sequence[Any]) -> None:
    """``GET /v1/keys`` behind ``tenant`` (authenticating) and the admin routes behind ``admin``."""

    async def own_keys(request: Request) -> dict[str, object]:
        """The caller's tenant's keys and what each was used for (no secrets)."""
        return {"object": "list", "data": [asdict(k) for k in await keys.usage_of(request.state.tenant)]}

    app.add_api_route(
        "/v1/keys", own_keys, methods=["GET"], dependencies=list(tenant), response_model=KeyList
    )
    routes = KeyAdminRoutes(keys)
    for path, endpoint, method, status, model in (
        ("/admin/v1/tenants/{name}/keys", routes.list_keys, "GET", 200, KeyList),
        ("/admin/v1/tenants/{name}/keys", routes.create_key, "POST", 201, KeyIssued),
        ("/admin/v1/tenants/{name}/keys/{key_id}/rotate", routes.rotate_key, "POST", 201, KeyIssued),
        ("/admin/v1/tenants/{name}/keys/{key_id}", routes.revoke_key, "DELETE", 200, KeyView),
        ("/admin/v1/tenants/{name}/audit", routes.audit, "GET", 200, AuditOut),
    ):
        app.add_api_route(
            path,
            endpoint,
            methods=[method],
            dependencies=list(admin),
            status_code=status,
            response_model=model,
        )
