"""The testing helpers: ports, a service process's base settings, the pytest plugin, the real Temporal
dev server."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from forge_kit.testing import TemporalDevServer, base_env, eventkeys, eventually, free_port, wait_for_port
from forge_kit.testing.processes import port_open


def _server_socket() -> socket.socket:
    """A listening socket as servers open theirs (gRPC, uvicorn, Go and Rust all set SO_REUSEADDR)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return sock


def test_free_port_is_bindable_by_a_server_and_by_no_one_else_until_then() -> None:
    picked = {free_port() for _ in range(40)}
    # Other processes binding port 0 meanwhile (servers, Temporal choosing its internal ports)
    # are not handed a picked port: with the kernel's plain pick, about one in 300 would be.
    for _ in range(6000):
        with socket.socket() as other:
            other.bind(("", 0))
            assert other.getsockname()[1] not in picked
    for port in picked:
        with _server_socket() as sock:
            sock.bind(("127.0.0.1", port))
            sock.listen()


@pytest.mark.integration
def test_wait_for_port_times_out_on_a_closed_port() -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=str(port := free_port())):
        wait_for_port(port, timeout_s=0.2)
    assert time.monotonic() - started < 2


def test_base_env_without_kafka_is_ports_token_data_dir_and_kafka_off() -> None:
    env = base_env("model_server", token="t", data_dir=Path("/d") / "ms")

    assert env == {
        "FORGE_MODEL_SERVER_GRPC_PORT": "0",
        "FORGE_MODEL_SERVER_HTTP_PORT": "0",
        "FORGE_MODEL_SERVER_AUTH_TOKEN": "t",
        "FORGE_MODEL_SERVER_DATA_DIR": "/d/ms",
        "FORGE_MODEL_SERVER_KAFKA_ENABLED": "false",
    }
    assert "FORGE_MODEL_SERVER_DATA_DIR" not in base_env("model_server", token="t")


def test_base_env_with_kafka_has_the_bootstrap_and_the_services_event_keys() -> None:
    env = base_env(
        "inference_gateway", token="t", data_dir="/d", kafka="127.0.0.1:9", grpc_port=1234, http_port="5678"
    )

    assert env == {
        "FORGE_INFERENCE_GATEWAY_GRPC_PORT": "1234",
        "FORGE_INFERENCE_GATEWAY_HTTP_PORT": "5678",
        "FORGE_INFERENCE_GATEWAY_AUTH_TOKEN": "t",
        "FORGE_INFERENCE_GATEWAY_DATA_DIR": "/d",
        "FORGE_INFERENCE_GATEWAY_KAFKA_BOOTSTRAP": "127.0.0.1:9",
        **eventkeys.service_env("inference_gateway"),
    }
    assert "FORGE_INFERENCE_GATEWAY_KAFKA_ENABLED" not in env
    with_cms = base_env("retriever", token="t", kafka="127.0.0.1:9", extra_producers=["cms"])
    assert "cms" in json.loads(with_cms["FORGE_RETRIEVER_EVENT_VERIFY_KEYS"])
    assert "cms" not in json.loads(
        base_env("retriever", token="t", kafka="k")["FORGE_RETRIEVER_EVENT_VERIFY_KEYS"]
    )


def test_base_env_puts_each_setting_upper_cased_under_the_prefix() -> None:
    env = base_env("eval", token="t", models_dir="/m", TORCH_THREADS="1", response_cache_path="")

    assert env["FORGE_EVAL_MODELS_DIR"] == "/m"
    assert env["FORGE_EVAL_TORCH_THREADS"] == "1"
    assert env["FORGE_EVAL_RESPONSE_CACHE_PATH"] == ""
    assert len(env) == 4 + 3
    # Off Kafka, KAFKA_BOOTSTRAP is an ordinary setting (base_env sets it only with kafka).
    assert base_env("eval", token="t", kafka_bootstrap="b")["FORGE_EVAL_KAFKA_BOOTSTRAP"] == "b"


@pytest.mark.parametrize(
    ("settings", "error"),
    [
        ({"auth_token": "other"}, "would override FORGE_EVAL_AUTH_TOKEN"),
        ({"GRPC_PORT": "1"}, "would override FORGE_EVAL_GRPC_PORT"),
        ({"DATA_DIR": "/elsewhere"}, "would override FORGE_EVAL_DATA_DIR"),
        ({"kafka_enabled": "true"}, "would override FORGE_EVAL_KAFKA_ENABLED"),
        (
            {"models_dir": "/a", "MODELS_DIR": "/b"},
            "models_dir and MODELS_DIR are both FORGE_EVAL_MODELS_DIR",
        ),
    ],
)
def test_base_env_refuses_a_setting_it_would_lose(settings: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        base_env("eval", token="t", data_dir="/d", **settings)


def test_base_env_refuses_a_value_that_is_not_text_and_keys_it_cannot_use() -> None:
    with pytest.raises(TypeError, match="torch_threads of eval is int, not str"):
        base_env("eval", token="t", torch_threads=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="need kafka"):
        base_env("retriever", token="t", extra_producers=["cms"])
    with pytest.raises(ValueError, match="would override FORGE_RETRIEVER_EVENT_VERIFY_KEYS"):
        base_env("retriever", token="t", kafka="k", event_verify_keys="{}")


async def test_eventually_returns_the_first_truthy_value_of_a_sync_or_async_probe() -> None:
    calls: list[int] = []

    def sync_probe() -> list[int]:
        calls.append(1)
        return calls if len(calls) == 3 else []

    async def async_probe() -> str:
        return "ready"

    assert await eventually(sync_probe, interval_s=0) == [1, 1, 1]
    assert await eventually(async_probe) == "ready"


async def test_eventually_fails_loudly_with_what_it_waited_for() -> None:
    with pytest.raises(AssertionError, match=r"not within 0.1s: the door to open \(last: 0\)"):
        await eventually(lambda: 0, timeout_s=0.1, what="the door to open")


def test_plugin_is_registered_through_the_entry_point(pytestconfig: pytest.Config) -> None:
    plugin = pytestconfig.pluginmanager.get_plugin("forge_kit")
    assert plugin is not None
    assert plugin.__name__ == "forge_kit.testing.plugin"
    markers = pytestconfig.getini("markers")
    assert any(m.startswith("integration:") for m in markers)


def test_unused_port_fixture(unused_port: int) -> None:
    with _server_socket() as sock:
        sock.bind(("127.0.0.1", unused_port))


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_temporal_dev_server_starts_and_stops() -> None:
    server = TemporalDevServer().start(timeout_s=45)
    try:
        assert port_open(server.port)
        assert server.target == f"127.0.0.1:{server.port}"
    finally:
        server.stop()
    assert server.proc is None
    assert not port_open(server.port)
