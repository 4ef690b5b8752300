"""The audit log: admin actions through a real gRPC server are written when the call ends —
allowed and denied alike — and secrets never reach the log or the audit file."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import structlog
from forge.rerank.v1 import rerank_pb2, rerank_pb2_grpc

from forge_kit import audit, logs
from forge_kit.grpckit import Principal, make_channel, require_admin
from forge_kit.logs import REDACTED, redact
from forge_kit.testing.grpcserver import grpc_test_server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]
TOKEN = "audit-service-token"
TEAM_TOKEN = "audit-team-token"
SERVICE_NAME = rerank_pb2.DESCRIPTOR.services_by_name["RerankerService"].full_name


class AdminOnly(rerank_pb2_grpc.RerankerServiceServicer):
    """``query`` = "admin": an admin action; "admin-fails": admin action whose work then fails."""

    async def Rerank(
        self, request: rerank_pb2.RerankRequest, context: grpc.aio.ServicerContext
    ) -> rerank_pb2.RerankResponse:
        if request.query.startswith("admin"):
            require_admin("ChangeQuota")
            if request.query == "admin-fails":
                raise RuntimeError("the work itself failed")
        return rerank_pb2.RerankResponse()


@pytest.fixture
def audit_dir(tmp_path: Path) -> Iterator[Path]:
    audit.configure(tmp_path)
    yield tmp_path
    audit._path = None


def team(token: str) -> Principal | None:
    return Principal("research-token", "team", "research") if token == TEAM_TOKEN else None


@pytest.mark.asyncio
async def test_admin_actions_are_audited_allowed_denied_and_failed(audit_dir: Path) -> None:
    async with grpc_test_server(
        rerank_pb2_grpc.add_RerankerServiceServicer_to_server,
        AdminOnly(),
        SERVICE_NAME,
        token=TOKEN,
        authenticators=[team],
    ) as server:
        async with make_channel(f"127.0.0.1:{server.port}", token=TOKEN) as admin:
            await rerank_pb2_grpc.RerankerServiceStub(admin).Rerank(rerank_pb2.RerankRequest(query="admin"))
            await rerank_pb2_grpc.RerankerServiceStub(admin).Rerank(rerank_pb2.RerankRequest(query="plain"))
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await rerank_pb2_grpc.RerankerServiceStub(admin).Rerank(
                    rerank_pb2.RerankRequest(query="admin-fails")
                )
            assert failed.value.code() is grpc.StatusCode.INTERNAL
        async with make_channel(f"127.0.0.1:{server.port}", token=TEAM_TOKEN) as other:
            with pytest.raises(grpc.aio.AioRpcError) as denied:
                await rerank_pb2_grpc.RerankerServiceStub(other).Rerank(
                    rerank_pb2.RerankRequest(query="admin")
                )
            assert denied.value.code() is grpc.StatusCode.PERMISSION_DENIED
    entries = audit.read()
    assert [(e["action"], e["actor"], e["outcome"]) for e in entries] == [
        ("ChangeQuota", "service", "OK"),
        ("ChangeQuota", "service", "INTERNAL"),
        ("ChangeQuota", "research-token", "PERMISSION_DENIED"),
    ]
    assert all(e["method"].endswith("/Rerank") and e["at"] for e in entries)
    lines = (audit_dir / audit.AUDIT_FILE).read_text().splitlines()
    assert len(lines) == 3 and all(json.loads(line) for line in lines)


def test_record_redacts_secret_details(audit_dir: Path) -> None:
    audit.record("IssueTeamToken", "service", "OK", team="research", token="tt-abc", nested={"api_key": "k"})
    (entry,) = audit.read()
    assert entry["team"] == "research"
    assert entry["token"] == REDACTED and entry["nested"] == {"api_key": REDACTED}
    assert "tt-abc" not in (audit_dir / audit.AUDIT_FILE).read_text()


def test_secrets_passed_to_the_log_are_redacted() -> None:
    event = logs._redact_event(None, "info", {"event": "login", "password": "hunter2", "Authorization": "x"})
    assert event == {"event": "login", "password": REDACTED, "Authorization": REDACTED}
    assert redact({"AUTH_TOKEN": "t", "name": "n"}) == {"AUTH_TOKEN": REDACTED, "name": "n"}
    # ... and every service's logger runs it (the configuration is restored afterwards).
    saved, handlers = structlog.get_config(), logging.getLogger().handlers[:]
    try:
        logs.configure_logging("audit-test", "INFO", json=True)
        assert logs._redact_event in structlog.get_config()["processors"]
    finally:
        structlog.configure(**saved)
        logging.getLogger().handlers[:] = handlers
