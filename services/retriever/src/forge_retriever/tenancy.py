"""Which tenant a call acts for.

Every document, chunk and index point belongs to one tenant, and every read and write of the
service is scoped to the caller's tenant; a search filter only narrows within it (the index ANDs
the tenant condition with the caller's filter), so no filter can reach another tenant's chunks.

The tenant is the caller's identity, never a request field (the retrieval protos have none):

* a principal that acts for one team (``role`` ``team``) is that team's tenant, and may not name
  another;
* the service token (``admin``: the gateway, ingestion tools, the CLI) names the tenant it acts for
  in the ``forge-tenant`` request metadata, after authenticating the end user itself — the gateway
  sends the tenant its API key resolved to;
* without it, the ``default`` tenant (the gateway's tenant of its bootstrap key).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from forge_kit import errors
from forge_kit.grpckit import Principal

#: gRPC request-metadata key an admin caller sets to act for a tenant.
TENANT_METADATA_KEY = "forge-tenant"
#: Tenant of calls that name none, and of every document written before tenants existed.
DEFAULT_TENANT = "default"

_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@-]{0,127}$")


def validate_tenant(field_name: str, tenant: str) -> None:
    """Tenant ids are index payload keywords and database keys: short, printable, no spaces."""
    if not _TENANT.fullmatch(tenant):
        raise errors.ValidationError(
            field_name,
            "must be letters, digits, '_', '.', ':', '@' or '-', start with a letter or digit,"
            " at most 128 characters",
        )


def caller_tenant(principal: Principal | None, metadata: Iterable[tuple[str, str | bytes]]) -> str:
    """The tenant a call acts for, from who made it and its request metadata.

    Raises ``ValidationError`` for a malformed ``forge-tenant`` (or more than one), and
    ``PermissionDeniedError`` when a team principal names a tenant other than its own.
    """
    named = [v.decode() if isinstance(v, bytes) else v for k, v in metadata if k == TENANT_METADATA_KEY]
    if len(named) > 1:
        raise errors.ValidationError(TENANT_METADATA_KEY, "must be given at most once")
    requested = named[0] if named else None
    if requested is not None:
        validate_tenant(TENANT_METADATA_KEY, requested)
    if principal is not None and not principal.is_admin:
        own = principal.team or principal.name
        if requested is not None and requested != own:
            raise errors.PermissionDeniedError(f"{principal.name} acts for tenant {own!r} only")
        return own
    return requested if requested is not None else DEFAULT_TENANT
