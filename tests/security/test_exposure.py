"""Issue 22, hole 8, from the attacker's side: another local user (or tenant) must not learn what
it should not from files on disk, the model list, RAG error answers, the process table or logs."""

from __future__ import annotations

import contextlib
import json
import stat
from pathlib import Path
from typing import Annotated, Any

import pytest
import typer
from typer.testing import CliRunner

from forge_kit import audit, clitools
from forge_kit.db import Database
from forge_kit.settings import ServiceSettings


def _others_can_access(path: Path) -> bool:
    return bool(stat.S_IMODE(path.stat().st_mode) & 0o077)


async def test_databases_are_private_to_their_service(tmp_path: Path) -> None:
    settings = ServiceSettings(data_dir=str(tmp_path / "var" / "data" / "svc"), kafka_enabled=False)
    db = Database(settings.sqlite_url("svc.db"))
    try:
        async with db.engine.begin() as conn:
            await conn.exec_driver_sql("create table t (secret text)")
            await conn.exec_driver_sql("insert into t values ('x')")
        files = sorted(Path(settings.data_dir).iterdir())
        assert {f.name for f in files} >= {"svc.db", "svc.db-wal", "svc.db-shm"}
        for path in [Path(settings.data_dir), tmp_path / "var", *files]:
            assert not _others_can_access(path), f"{path} is {oct(path.stat().st_mode)}"
    finally:
        await db.dispose()


async def test_a_database_named_by_url_is_private(tmp_path: Path) -> None:
    path = tmp_path / "state" / "direct.db"
    path.parent.mkdir()
    db = Database(f"sqlite+aiosqlite:///{path}")
    try:
        async with db.engine.begin() as conn:
            await conn.exec_driver_sql("create table t (x int)")
        assert not _others_can_access(path)
    finally:
        await db.dispose()


def test_the_audit_log_is_private(tmp_path: Path) -> None:
    before = audit.path()
    folder = tmp_path / "var" / "data" / "scheduler"
    try:
        log = audit.configure(folder)
        audit.record("SetQuota", "alice", "OK", team="a")
        assert not _others_can_access(log) and not _others_can_access(folder)
        log.chmod(0o644)  # loosened by hand: the next write tightens it again
        audit.record("SetQuota", "alice", "OK", team="b")
        assert not _others_can_access(log)
    finally:
        audit._path = before


def test_the_eval_response_cache_is_private(tmp_path: Path) -> None:
    from forge_eval.backend import ResponseCache

    path = tmp_path / "var" / "cache" / "eval" / "responses.sqlite"
    ResponseCache(path)
    assert not _others_can_access(path) and not _others_can_access(path.parent)


CHECKPOINT = "/srv/forge/var/checkpoints/team-a/run-17/hf"


async def test_model_list_shows_tenants_no_host_path(tmp_path: Path) -> None:
    """A replica that lists its checkpoint's path (vLLM does, as did Forge's model server): the
    gateway's /v1/models shows a tenant the model id instead."""
    import asyncio

    import httpx
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import PlainTextResponse

    from forge_inference_gateway.caching.response_cache import ResponseCache
    from forge_inference_gateway.openai_api import install_gateway_api
    from forge_inference_gateway.replicas.pool import ReplicaPool, RoutingPolicy
    from forge_inference_gateway.replicas.upstream import ModelServerClient
    from forge_inference_gateway.service import InferenceGateway
    from forge_kit.cache import InMemoryCache
    from forge_kit.http import make_app

    card = {"id": "tiny", "object": "model", "owned_by": "forge", "created": 1, "root": CHECKPOINT}
    upstream = FastAPI()
    upstream.add_api_route("/v1/models", lambda: {"object": "list", "data": [{**card, "parent": CHECKPOINT}]})
    upstream.add_api_route("/metrics", lambda: PlainTextResponse(""))
    server = uvicorn.Server(
        uvicorn.Config(upstream, host="127.0.0.1", port=0, log_config=None, lifespan="off")
    )
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    db = Database(f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}")
    await db.migrate(Path(__import__("forge_inference_gateway").__file__).parent / "migrations")
    pool = ReplicaPool([url], lambda u: ModelServerClient(u, "upstream-token"), RoutingPolicy())
    gateway = InferenceGateway(
        db, InMemoryCache(), pool, responses=ResponseCache(InMemoryCache()), internal_token="admin-token"
    )
    await gateway.tenants.bootstrap("tenant-key")
    app = make_app("inference_gateway")
    install_gateway_api(app, gateway, "admin-token")
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app),
            base_url="http://gateway",
            headers={"Authorization": "Bearer tenant-key"},
        ) as client:
            reply = await client.get("/v1/models")
        assert reply.status_code == 200, reply.text
        assert "/srv/forge" not in reply.text
        [listed] = reply.json()["data"]
        assert (listed["id"], listed["root"], listed["owned_by"], listed["created"]) == (
            "tiny",
            "tiny",
            "forge",
            1,
        )
    finally:
        await pool.close()
        await db.dispose()
        server.should_exit = True
        await task


def test_the_model_servers_list_has_no_host_path() -> None:
    from forge_model_server.entrypoints.openai_api import model_card
    from forge_model_server.service import ModelInfo

    info = ModelInfo("tiny", "3", CHECKPOINT, 1, 64, ("model.safetensors",))
    card = model_card(info, loaded=True)
    assert CHECKPOINT not in json.dumps(card) and card["root"] == "tiny"


async def test_another_tenants_collection_answers_like_a_missing_one(tmp_path: Path) -> None:
    """Search and delete in a collection only another tenant has documents in: the same error,
    status and message pattern as a collection nobody has (the gateway's RAG path relays it)."""
    from forge_kit import errors
    from forge_retriever.config import RetrieverSettings
    from forge_retriever.documents import DocumentIn, SearchMode
    from forge_retriever.index import QdrantEdgeIndex
    from forge_retriever.service import RetrieverService

    db = Database(f"sqlite+aiosqlite:///{tmp_path / 'retriever.db'}")
    await db.migrate(Path(__import__("forge_retriever").__file__).parent / "migrations")
    index = QdrantEdgeIndex(tmp_path / "index")
    try:
        settings = RetrieverSettings(data_dir=str(tmp_path), kafka_enabled=False)
        service = RetrieverService(db, index, settings)
        await service.reconcile_index()
        await service.upsert_documents("acme-board", [DocumentIn(id="m", text="merger plans")], tenant="acme")
        answers = {}
        for name in ("acme-board", "no-such-collection"):
            with pytest.raises(errors.ForgeError) as search:
                await service.search(name, "merger", 5, SearchMode.SPARSE, {}, tenant="globex")
            with pytest.raises(errors.ForgeError) as delete:
                await service.delete_documents(name, ["m"], tenant="globex")
            answers[name] = [
                (type(e.value).__name__, e.value.message.replace(name, "<name>")) for e in (search, delete)
            ]
        assert answers["acme-board"] == answers["no-such-collection"]
        assert answers["acme-board"][0] == ("ValidationError", "collection: unknown collection '<name>'")
        # The owner still finds it.
        found = await service.search("acme-board", "merger", 5, SearchMode.SPARSE, {}, tenant="acme")
        assert [h.document_id for h in found.hits] == ["m"]
    finally:
        index.close()
        await db.dispose()


def _commands(command: Any, path: str = "forge") -> list[tuple[str, Any]]:
    """Every command under the ``forge`` group (plugins loaded), with its path."""
    found = [(path, command)]
    if hasattr(command, "list_commands"):
        ctx = type(command).context_class(command)
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is not None:
                found += _commands(sub, f"{path} {name}")
    return found


def test_no_command_takes_a_token_on_its_command_line() -> None:
    """Arguments show in ``ps`` to every local user: tokens come from a file or the environment."""
    from forge_cli.main import app

    commands = _commands(typer.main.get_command(app))
    assert any(path == "forge eval run" for path, _ in commands)  # the plugins were walked
    offenders = [
        f"{path} {opt}"
        for path, command in commands
        for param in getattr(command, "params", [])
        if param.param_type_name == "option"
        for opt in param.opts
        if opt.endswith(("-token", "-key", "password", "secret"))
    ]
    assert offenders == []


def test_eval_run_refuses_a_token_flag_and_reads_a_token_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from forge_eval.cli import app

    secret = "tok-" + "x" * 20
    flagged = CliRunner().invoke(
        app,
        [
            "run",
            "--task",
            "gsm8k",
            "--endpoint",
            "http://127.0.0.1:1",
            "--model",
            "m",
            "--out",
            str(tmp_path),
            "--token",
            secret,
        ],
    )
    assert flagged.exit_code == 2 and "No such option: --token" in flagged.output, flagged.output

    probe = typer.Typer()

    @probe.command()
    def show(token: Annotated[str, clitools.token_option("FORGE_TEST_PROBE_TOKEN", "token")] = "") -> None:
        typer.echo(f"got={token}")

    file = tmp_path / "token"
    file.write_text(secret + "\n")
    assert CliRunner().invoke(probe, ["--token-file", str(file)]).output.strip() == f"got={secret}"
    monkeypatch.setenv("FORGE_TEST_PROBE_TOKEN", "from-env")
    assert CliRunner().invoke(probe, []).output.strip() == "got=from-env"
    assert (
        CliRunner().invoke(probe, ["--token-file", "-"], input=secret + "\n").output.strip()
        == f"got={secret}"
    )
    missing = CliRunner().invoke(probe, ["--token-file", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "cannot read the token" in missing.output


async def test_a_500_is_logged_with_its_stack_trace(capfd: pytest.CaptureFixture[str]) -> None:
    """A route that fails unexpectedly, served by uvicorn as the services are: the caller gets a
    bare 500, and the log line carries the traceback text (not ``<traceback object at 0x…>``)."""
    import asyncio
    import logging

    import httpx
    import structlog
    import uvicorn

    from forge_kit.http import make_app
    from forge_kit.logs import configure_logging

    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    configure_logging("probe", json=True)

    def explode_in_the_handler() -> None:
        raise RuntimeError("disk full while writing the ledger")

    app = make_app("probe")
    app.add_api_route("/boom", explode_in_the_handler, methods=["GET"])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, lifespan="off"))
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        async with httpx.AsyncClient() as client:
            reply = await client.get(f"http://127.0.0.1:{port}/boom")
        assert reply.status_code == 500 and "ledger" not in reply.text
    finally:
        server.should_exit = True
        await task
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
        structlog.reset_defaults()
    lines = [json.loads(line) for line in capfd.readouterr().err.splitlines() if line.startswith("{")]
    failures = [line for line in lines if "exception" in line or "exc_info" in line]
    assert failures, lines
    text = json.dumps(failures)
    assert "<traceback object" not in text
    assert (
        "explode_in_the_handler" in failures[0]["exception"]
        and "RuntimeError: disk full" in failures[0]["exception"]
    )
