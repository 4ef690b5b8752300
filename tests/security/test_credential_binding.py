"""Attacker's side: a service must not forward its own credential to an
address its caller picks.

- Eval: a user (a non-admin eval token) asks for a run against an endpoint it controls — a local
  listener standing in for an attacker's server. The run is refused and the listener hears
  nothing; an admin's run against it reaches it without any Authorization header; the gateway's
  key still reaches the registered gateway address.
- Gateway: an admin adds a replica URL pointing at a listener. The gateway's scrapes reach it,
  but never with the model-server token the gateway holds; a replica added with a token of its
  own receives exactly that token.

Real service processes (eval, inference gateway), real HTTP.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import httpx
import pytest
from forge.common.v1 import common_pb2
from forge.eval.v1 import eval_pb2, eval_pb2_grpc

from forge_kit.grpckit import make_channel
from forge_kit.paths import data_dir
from forge_kit.testing import ServiceProcess, base_env, free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

DATA = data_dir()
EVAL_TOKEN = "eval-service-token"
EVAL_USER_TOKEN = "eval-user-token"
GATEWAY_KEY = "gateway-key-issued-to-eval"
GATEWAY_ADMIN = "gateway-admin-token"
MODEL_SERVER_TOKEN = "model-server-secret"


class Listener:
    """A local HTTP server that records the path and Authorization header of every request and
    answers like an empty model server (``/metrics``: nothing; ``/v1/models``: no models)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str | None]] = []
        seen = self.seen

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                seen.append((self.path, self.headers.get("Authorization")))
                status, body, kind = 200, b"", "text/plain"
                if self.path.startswith("/v1/models"):
                    body, kind = json.dumps({"object": "list", "data": []}).encode(), "application/json"
                elif not self.path.startswith("/metrics"):
                    status, body, kind = 404, b'{"error": "not found"}', "application/json"
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def headers(self) -> set[str | None]:
        return {auth for _, auth in list(self.seen)}

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def listen() -> Iterator[Callable[[], Listener]]:
    started: list[Listener] = []

    def start() -> Listener:
        started.append(Listener())
        return started[-1]

    yield start
    for listener in started:
        listener.close()


def wait_until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


# --- eval ------------------------------------------------------------------------------------


@pytest.fixture
def eval_service(tmp_path: Path, listen: Callable[[], Listener]) -> Iterator[tuple[ServiceProcess, Listener]]:
    """The eval service with the gateway (a listener) as its registered endpoint and key."""
    gateway = listen()
    process = ServiceProcess(
        "forge_eval",
        env=base_env(
            "eval",
            token=EVAL_TOKEN,
            data_dir=tmp_path / "eval",
            grpc_port=free_port(),
            http_port=free_port(),
            response_cache_path="",
            user_tokens=json.dumps({"ci": EVAL_USER_TOKEN}),
            inference_gateway_url=gateway.url,
            inference_gateway_token=GATEWAY_KEY,
            corpora_dir=str(DATA / "corpora"),
            benchmarks_dir=str(DATA / "benchmarks"),
        ),
        log_path=str(tmp_path / "eval.log"),
    ).start(90)
    yield process, gateway
    process.stop()


async def run_suite(process: ServiceProcess, token: str, endpoint: str) -> str:
    async with make_channel(process.grpc_target, token=token) as channel:
        stub = eval_pb2_grpc.EvalServiceStub(channel)
        try:
            await stub.RegisterModel(
                eval_pb2.RegisterModelRequest(
                    ref=common_pb2.ModelRef(name="m", version="1"), uri="file:///m"
                ),
                timeout=30,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.ALREADY_EXISTS:
                raise
        reply = await stub.RunSuite(
            eval_pb2.RunSuiteRequest(
                suite="tinyshakespeare_ppl",
                model=common_pb2.ModelRef(name="m", version="1"),
                endpoint=endpoint,
                limit=2,
                seed=1,
            ),
            timeout=30,
        )
    return reply.run_id


async def test_a_users_run_against_an_address_it_picks_is_refused_and_sends_nothing(
    eval_service: tuple[ServiceProcess, Listener], listen: Callable[[], Listener]
) -> None:
    process, gateway = eval_service
    attacker = listen()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await run_suite(process, EVAL_USER_TOKEN, attacker.url)
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED, caught.value.details()
    assert "not a registered model endpoint" in (caught.value.details() or "")
    # Spellings of the same unregistered address, or a credential smuggled in the URL: refused too.
    for spelled in (
        attacker.url + "/",
        attacker.url.replace("127.0.0.1", "localhost"),
        f"http://u:p@{attacker.url[7:]}",
    ):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await run_suite(process, EVAL_USER_TOKEN, spelled)
        assert caught.value.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT)
    # The user's run against the registered gateway goes through, with the key issued for it.
    await run_suite(process, EVAL_USER_TOKEN, gateway.url + "/")
    wait_until(lambda: bool(gateway.seen), 30, "the run to query the gateway")
    assert gateway.headers() == {f"Bearer {GATEWAY_KEY}"}
    time.sleep(1.0)
    assert attacker.seen == []


async def test_an_admins_run_against_an_unregistered_address_carries_no_credential(
    eval_service: tuple[ServiceProcess, Listener], listen: Callable[[], Listener]
) -> None:
    process, _ = eval_service
    elsewhere = listen()
    await run_suite(process, EVAL_TOKEN, elsewhere.url)
    wait_until(lambda: bool(elsewhere.seen), 30, "the run to query the endpoint")
    assert elsewhere.headers() == {None}, elsewhere.seen


# --- inference gateway ---------------------------------------------------------------------------


@pytest.fixture
def gateway(tmp_path: Path, listen: Callable[[], Listener]) -> Iterator[tuple[ServiceProcess, Listener]]:
    """The gateway with one configured replica (a listener) and the model-server token it holds."""
    configured = listen()
    process = ServiceProcess(
        "forge_inference_gateway",
        env=base_env(
            "inference_gateway",
            token=GATEWAY_ADMIN,
            data_dir=tmp_path / "gateway",
            grpc_port=free_port(),
            http_port=free_port(),
            model_server_url=configured.url,
            model_server_token=MODEL_SERVER_TOKEN,
            metrics_interval_s="0.2",
            replica_sync_s="0.5",
        ),
        log_path=str(tmp_path / "gateway.log"),
    ).start(90)
    yield process, configured
    process.stop()


def test_an_admin_added_replica_never_receives_the_gateways_model_server_token(
    gateway: tuple[ServiceProcess, Listener], listen: Callable[[], Listener]
) -> None:
    process, configured = gateway
    added, with_token = listen(), listen()
    admin = {"Authorization": f"Bearer {GATEWAY_ADMIN}"}
    with httpx.Client(base_url=process.http_url, headers=admin, timeout=30) as http:
        reply = http.post("/admin/v1/replicas", json={"url": added.url})
        assert reply.status_code == 201, reply.text
        reply = http.post("/admin/v1/replicas", json={"url": with_token.url, "token": "issued-for-it"})
        assert reply.status_code == 201, reply.text
    wait_until(
        lambda: (
            sum(p.startswith("/metrics") for p, _ in list(added.seen)) >= 3
            and sum(p.startswith("/metrics") for p, _ in list(with_token.seen)) >= 3
        ),
        30,
        "scrapes of the added replicas",
    )
    assert configured.headers() == {f"Bearer {MODEL_SERVER_TOKEN}"}  # the configured one is trusted
    assert added.headers() == {None}, added.seen
    assert with_token.headers() == {"Bearer issued-for-it"}, with_token.seen
    with httpx.Client(base_url=process.http_url, headers=admin, timeout=30) as http:
        # The listing does not hand the replica's token back.
        listed = http.get("/admin/v1/replicas")
        assert listed.status_code == 200 and "issued-for-it" not in listed.text
        # A token that would break the header it goes into is refused.
        reply = http.post("/admin/v1/replicas", json={"url": listen().url, "token": "a\r\nX-Evil: 1"})
    assert reply.status_code == 400, reply.text
