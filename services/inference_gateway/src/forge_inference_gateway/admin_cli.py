"""``forge tenants`` (admins: tenants and their API keys) and ``forge rag`` (operators: a tenant's
vector stores and documents), over the gateway's HTTP API.

``forge tenants`` authenticates with the gateway's service token (``--token-file``,
``$FORGE_CLI_INFERENCE_GATEWAY_TOKEN`` or ``var/secrets/tokens.json``); ``forge rag`` with a tenant
API key (``--api-key-file`` or ``$FORGE_CLI_RAG_API_KEY``), exactly as a product app would.
Registered under the ``forge.cli`` entry-point group as ``tenants`` and ``rag``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer

from forge_kit import clitools

tenants_app = typer.Typer(add_completion=False, help="Tenants of the inference gateway and their API keys.")
rag_app = typer.Typer(add_completion=False, help="A tenant's vector stores and documents on the gateway.")

UrlOption = typer.Option("--url", envvar="FORGE_CLI_GATEWAY_URL", help="The gateway's HTTP address.")
JsonOption = typer.Option("--json", help="Print JSON.")
TokenOption = clitools.token_option("FORGE_CLI_INFERENCE_GATEWAY_TOKEN", "gateway's service token")
ApiKeyOption = clitools.token_option("FORGE_CLI_RAG_API_KEY", "tenant API key", "--api-key-file")
KEY_COLUMNS = ["id", "name", "prefix", "scopes", "state", "expires_at", "last_used_at", "usage"]


def _call(url: str, token: str, method: str, path: str, **kwargs: Any) -> Any:
    """One request; an HTTP error becomes one red line (``clitools.run_rpc``'s convention)."""
    try:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=120) as client:
            reply = client.request(method, path, **kwargs)
            reply.raise_for_status()
            return reply.json()
    except httpx.HTTPError as exc:
        message = clitools.describe_error(exc) or str(exc)
        clitools.error_console.print(f"[red]error[/]: {message}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None


def _admin(url: str, token: str, method: str, path: str, **kwargs: Any) -> Any:
    return _call(url, clitools.resolve_token("inference_gateway", token), method, path, **kwargs)


@tenants_app.command("list")
def list_tenants(
    url: Annotated[str, UrlOption] = "http://127.0.0.1:8080",
    token: Annotated[str, TokenOption] = "",
    as_json: Annotated[bool, JsonOption] = False,
) -> None:
    """The tenants, their priority class and rate limit."""
    rows = _admin(url, token, "GET", "/admin/v1/tenants")["tenants"]
    clitools.show_rows(rows, ["name", "id", "priority_class", "rpm_limit", "allow_training"], as_json)


@tenants_app.command("create")
def create_tenant(
    name: str,
    priority_class: Annotated[str, typer.Option(help="interactive or batch")] = "interactive",
    rpm_limit: Annotated[int | None, typer.Option(help="Requests per minute")] = None,
    url: Annotated[str, UrlOption] = "http://127.0.0.1:8080",
    token: Annotated[str, TokenOption] = "",
) -> None:
    """Create a tenant; its first API key (every scope) is printed this once."""
    body = {"name": name, "priority_class": priority_class, "rpm_limit": rpm_limit}
    made = _admin(url, token, "POST", "/admin/v1/tenants", json=body)
    typer.echo(made["api_key"])


@tenants_app.command("keys")
def list_keys(
    tenant: str,
    url: Annotated[str, UrlOption] = "http://127.0.0.1:8080",
    token: Annotated[str, TokenOption] = "",
    as_json: Annotated[bool, JsonOption] = False,
) -> None:
    """The tenant's keys: prefix, scopes, state, last use and usage (never the secret)."""
    clitools.show_rows(
        _admin(url, token, "GET", f"/admin/v1/tenants/{tenant}/keys")["data"], KEY_COLUMNS, as_json
    )


@tenants_app.command("create-key")
def create_key(
    tenant: str,
    name: Annotated[str, typer.Option("--name", help="What the key is for")],
    scope: Annotated[
        list[str] | None,
        typer.Option("--scope", help="inference, rag:read, rag:write, embeddings (repeat); all if none"),
    ] = None,
    expires_in: Annotated[float | None, typer.Option(help="Seconds until the key stops working")] = None,
    url: Annotated[str, UrlOption] = "http://127.0.0.1:8080",
    token: Annotated[str, TokenOption] = "",
) -> None:
    """A new key for the tenant; the secret is printed this once."""
    body = {"name": name, "scopes": scope or None, "expires_in_s": expires_in}
    typer.echo(_admin(url, token, "POST", f"/admin/v1/tenants/{tenant}/keys", json=body)["api_key"])


@tenants_app.command("rotate-key")
def rotate_key(
    tenant: str,
    key: Annotated[str, typer.Argument(help="Key id or name")],
    overlap: Annotated[float, typer.Option(help="Seconds the old key keeps working")] = 3600.0,
    url: Annotated[str, UrlOption] = "http://127.0.0.1:8080",
    token: Annotated[str, TokenOption] = "",
) -> None:
    """A new secret for the key; the old one works ``--overlap`` seconds more. Prints the new secret."""
    made = _admin(
        url, token, "POST", f"/admin/v1/tenants/{tenant}/keys/{key}/rotate", json={"overlap_s": overlap}
    )
    typer.echo(made["api_key"])


@tenants_app.command("revoke-key")
def revoke_key(
    tenant: str,
    key: Annotated[str, typer.Argument(help="Key id or name")],
    url: Annotated[str, UrlOption] = "http://127.0.0.1:8080",
    token: Annotated[str, TokenOption] = "",
) -> None:
    """The key stops working now."""
    clitools.show_record(_admin(url, token, "DELETE", f"/admin/v1/tenants/{tenant}/keys/{key}"), False)


@tenants_app.command("audit")
def audit(
    tenant: str,
    url: Annotated[str, UrlOption] = "http://127.0.0.1:8080",
    token: Annotated[str, TokenOption] = "",
    as_json: Annotated[bool, JsonOption] = False,
) -> None:
    """Every change to the tenant's keys: what, which key, who, when."""
    events = _admin(url, token, "GET", f"/admin/v1/tenants/{tenant}/audit", params={"limit": 1000})["events"]
    clitools.show_rows(events, ["seq", "at", "action", "key_id", "actor", "detail"], as_json)


@rag_app.command("stores")
def stores(
    url: Annotated[str, UrlOption] = "http://127.0.0.1:8080",
    api_key: Annotated[str, ApiKeyOption] = "",
    as_json: Annotated[bool, JsonOption] = False,
) -> None:
    """The tenant's vector stores and their file counts."""
    rows = _call(url, api_key, "GET", "/v1/vector_stores", params={"limit": 100})["data"]
    clitools.show_rows(rows, ["id", "name", "status", "file_counts", "usage_bytes"], as_json)


@rag_app.command("create-store")
def create_store(
    name: str,
    url: Annotated[str, UrlOption] = "http://127.0.0.1:8080",
    api_key: Annotated[str, ApiKeyOption] = "",
) -> None:
    """Create a vector store; prints its id."""
    typer.echo(_call(url, api_key, "POST", "/v1/vector_stores", json={"name": name})["id"])


@rag_app.command("upload")
def upload(
    store: str,
    files: Annotated[list[Path], typer.Argument(exists=True, dir_okay=False, help="UTF-8 text files")],
    wait: Annotated[float, typer.Option(help="Seconds to wait for indexing (0: do not wait)")] = 300.0,
    url: Annotated[str, UrlOption] = "http://127.0.0.1:8080",
    api_key: Annotated[str, ApiKeyOption] = "",
    as_json: Annotated[bool, JsonOption] = False,
) -> None:
    """Upload files and attach them to the store; wait until each is completed or failed."""
    attached = []
    for path in files:
        with path.open("rb") as handle:
            made = _call(
                url,
                api_key,
                "POST",
                "/v1/files",
                files={"file": (path.name, handle)},
                data={"purpose": "assistants"},
            )
        attached.append(
            _call(url, api_key, "POST", f"/v1/vector_stores/{store}/files", json={"file_id": made["id"]})
        )
    deadline = time.monotonic() + wait
    while wait and any(f["status"] == "in_progress" for f in attached) and time.monotonic() < deadline:
        time.sleep(0.5)
        attached = [
            _call(url, api_key, "GET", f"/v1/vector_stores/{store}/files/{f['id']}") for f in attached
        ]
    clitools.show_rows(attached, ["id", "status", "last_error", "usage_bytes"], as_json)
    if any(f["status"] != "completed" for f in attached):
        raise typer.Exit(1)


@rag_app.command("files")
def files_of(
    store: str,
    url: Annotated[str, UrlOption] = "http://127.0.0.1:8080",
    api_key: Annotated[str, ApiKeyOption] = "",
    as_json: Annotated[bool, JsonOption] = False,
) -> None:
    """The store's documents and their status."""
    rows = _call(url, api_key, "GET", f"/v1/vector_stores/{store}/files", params={"limit": 100})["data"]
    clitools.show_rows(rows, ["id", "status", "last_error", "usage_bytes", "attributes"], as_json)


@rag_app.command("search")
def search(
    store: str,
    query: str,
    max_results: Annotated[int, typer.Option(help="Chunks to return")] = 5,
    url: Annotated[str, UrlOption] = "http://127.0.0.1:8080",
    api_key: Annotated[str, ApiKeyOption] = "",
    as_json: Annotated[bool, JsonOption] = False,
) -> None:
    """Search the store."""
    body = {"query": query, "max_num_results": max_results}
    hits = _call(url, api_key, "POST", f"/v1/vector_stores/{store}/search", json=body)["data"]
    rows = [
        {
            "file_id": h["file_id"],
            "filename": h["filename"],
            "score": round(h["score"], 4),
            "text": h["content"][0]["text"][:120],
        }
        for h in hits
    ]
    clitools.show_rows(rows, ["file_id", "filename", "score", "text"], as_json)


@rag_app.command("delete-store")
def delete_store(
    store: str,
    url: Annotated[str, UrlOption] = "http://127.0.0.1:8080",
    api_key: Annotated[str, ApiKeyOption] = "",
) -> None:
    """Delete the store and take its documents out of the index (the uploaded files stay)."""
    _call(url, api_key, "DELETE", f"/v1/vector_stores/{store}")
    typer.echo(f"deleted {store}")
