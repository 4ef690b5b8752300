"""The platform table (`forge_cli.platform`): tokens, each service's environment, and the table
against the services' own settings classes."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import pytest

from forge_cli import platform, tokens
from forge_cli.platform import Infra, ServiceSpec, grpc, http

# --- tokens -------------------------------------------------------------------------------------


def test_tokens_are_private_stable_and_grow_with_new_services(tmp_path: Path) -> None:
    path = tmp_path / "var" / "secrets" / "tokens.json"
    first = tokens.load_or_create(path, ["scheduler", "eval"])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert first["scheduler"] != first["eval"] and len(first["scheduler"]) >= 32
    again = tokens.load_or_create(path, ["scheduler", "eval"])
    assert again == first
    grown = tokens.load_or_create(path, ["scheduler", "eval", "retriever"])
    assert grown["scheduler"] == first["scheduler"] and "retriever" in grown
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_token_file_with_loose_permissions_is_tightened(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    tokens.load_or_create(path, ["scheduler"])
    path.chmod(0o644)
    tokens.load_or_create(path, ["scheduler"])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


# --- the platform table -------------------------------------------------------------------------

TABLE = (
    ServiceSpec("alpha", grpc_port=1001, http_port=2001),
    ServiceSpec("beta", grpc_port=1002, http_port=2002, calls=(grpc("alpha"),)),
    ServiceSpec(
        "gamma",
        grpc_port=1003,
        http_port=2003,
        calls=(http("beta"), grpc("alpha")),
        temporal=True,
        extra={"model_dir": "{root}/var/models"},
    ),
)
TOKENS = {"alpha": "tok-a", "beta": "tok-b", "gamma": "tok-g"}
EVENT_KEYS = {name: tokens.new_event_key() for name in TOKENS}
SECRETS: dict[str, Any] = {"event_keys": EVENT_KEYS, "generated": {}}


def test_env_has_exactly_the_declared_keys_of_each_service() -> None:
    root = Path("/repo")
    for spec in TABLE:
        env = platform.service_env(spec, TABLE, TOKENS, root, **SECRETS)
        assert sorted(env) == sorted(spec.prefix + key for key in platform.declared_keys(spec))
        assert all(key.startswith(spec.prefix) for key in env)


def test_env_wires_targets_urls_and_only_the_callees_tokens() -> None:
    infra = Infra(kafka_port=9999, temporal_port=7777)
    env = platform.service_env(TABLE[2], TABLE, TOKENS, Path("/repo"), infra, **SECRETS)
    assert env["FORGE_GAMMA_AUTH_TOKEN"] == "tok-g"
    assert env["FORGE_GAMMA_BETA_URL"] == "http://127.0.0.1:2002"
    assert env["FORGE_GAMMA_BETA_TOKEN"] == "tok-b"
    assert env["FORGE_GAMMA_ALPHA_TARGET"] == "127.0.0.1:1001"
    assert env["FORGE_GAMMA_ALPHA_TOKEN"] == "tok-a"
    assert env["FORGE_GAMMA_TEMPORAL_TARGET"] == "127.0.0.1:7777"
    assert env["FORGE_GAMMA_KAFKA_BOOTSTRAP"] == "127.0.0.1:9999"
    assert env["FORGE_GAMMA_DATA_DIR"] == "/repo/var/data/gamma"
    assert env["FORGE_GAMMA_OBJECT_STORE_URL"] == "/repo/var/objects"
    assert env["FORGE_GAMMA_MODEL_DIR"] == "/repo/var/models"
    leaf = platform.service_env(TABLE[0], TABLE, TOKENS, Path("/repo"), **SECRETS)
    assert "tok-b" not in leaf.values() and "tok-g" not in leaf.values()


def test_a_tracking_service_gets_the_mlflow_server() -> None:
    spec = ServiceSpec("delta", grpc_port=1004, http_port=2004, tracking=True)
    secrets = {"event_keys": {**EVENT_KEYS, "delta": tokens.new_event_key()}, "generated": {}}
    table = (*TABLE, spec)
    env = platform.service_env(
        spec, table, {**TOKENS, "delta": "tok-d"}, Path("/repo"), Infra(mlflow_port=8123), **secrets
    )
    assert env["FORGE_DELTA_MLFLOW_URI"] == "http://127.0.0.1:8123"
    assert "MLFLOW_URI" in platform.declared_keys(spec)
    assert "FORGE_GAMMA_MLFLOW_URI" not in platform.service_env(
        TABLE[2], TABLE, TOKENS, Path("/repo"), **SECRETS
    )


def test_the_real_table_is_consistent() -> None:
    assert platform.validate(platform.SERVICES) == []
    assert {s.name for s in platform.SERVICES} == {
        "scheduler",
        "trainer_agent",
        "model_server",
        "inference_gateway",
        "retriever",
        "reranker",
        "eval",
        "preference_feedback",
        "orchestrator",
    }


def test_forge_up_starts_no_fixed_model_server_and_the_gateway_gets_no_static_replica() -> None:
    """Serving under `forge up` is the deployments' vLLM replicas: the model server's row stays in
    the table (Compose and Kubernetes run it, and wire the gateway to it) but starts no process
    here, the main job's steps do not see it, and the gateway starts with an empty pool."""
    local = platform.local_table()
    started = {s.name for s in platform.started(local)}
    assert "model_server" in {s.name for s in local}
    assert "model_server" not in started
    assert {"trainer_agent", "trainer_agent_3", "inference_gateway", "eval"} <= started
    gateway = next(s for s in local if s.name == "inference_gateway")
    names = [s.name for s in local]
    env = platform.service_env(
        gateway,
        local,
        {n: f"tok-{n}" for n in names},
        Path("/repo"),
        event_keys={s.service: EVENT_KEYS["alpha"] for s in local},
        generated={platform.generated_name(gateway, "BOOTSTRAP_API_KEY"): "k"},
    )
    assert env["FORGE_INFERENCE_GATEWAY_MODEL_SERVER_URL"] == ""


def test_validate_names_the_problem() -> None:
    bad = (*TABLE, ServiceSpec("delta", grpc_port=1001, http_port=2004, calls=(grpc("nobody"),)))
    problems = platform.validate(bad)
    assert "port 1001 used twice" in problems
    assert "delta calls unknown service 'nobody'" in problems


def test_select_rejects_unknown_services() -> None:
    assert platform.select([""]) == ()
    assert [s.name for s in platform.select(["eval", "scheduler"])] == ["scheduler", "eval"]
    with pytest.raises(ValueError, match="nope"):
        platform.select(["nope"])


# --- the table against the services' own settings classes ---------------------------------------

# Fields that name an address but are not calls between Forge services: every service's
# (forge_kit.settings.ServiceSettings) infrastructure, the retriever's optional Qdrant server
# (QDRANT_URL; empty = the embedded Qdrant Edge) and the orchestrator's optional Prometheus
# (GATEWAY_METRICS_PROMETHEUS_URL, an operator's, for gateway replicas behind one Service;
# empty = each gateway's /metrics).
NOT_CALLS = {"DATABASE_URL", "REDIS_URL", "OBJECT_STORE_URL", "QDRANT_URL", "GATEWAY_METRICS_PROMETHEUS_URL"}


def _settings_fields(spec: ServiceSpec) -> set[str] | None:
    """Upper-case field names of the service's settings class, or None if it is not installed."""
    import importlib
    import inspect

    from forge_kit.settings import ServiceSettings

    try:
        module = importlib.import_module(f"{spec.module}.config")
    except ModuleNotFoundError:
        return None
    classes = [
        c
        for _, c in inspect.getmembers(module, inspect.isclass)
        if issubclass(c, ServiceSettings) and c is not ServiceSettings and c.__module__ == module.__name__
    ]
    assert len(classes) == 1, f"{spec.module}.config should define one settings class, found {classes}"
    return {name.upper() for name in classes[0].model_fields}


@pytest.mark.parametrize("spec", platform.SERVICES, ids=lambda s: s.name)
def test_table_matches_the_service_settings(spec: ServiceSpec) -> None:
    """What `forge up` passes must be declared (or the service refuses to start), and every
    `<target>_target` / `<target>_url` the service declares must be wired by the table."""
    fields = _settings_fields(spec)
    if fields is None:
        pytest.skip(f"{spec.module} is not installed")
    declared = set(platform.declared_keys(spec))
    assert declared - fields == set(), "the table passes settings the service does not declare"
    addresses = {f for f in fields if f.endswith(("_TARGET", "_URL")) and f not in NOT_CALLS}
    assert addresses - declared == set(), "the service declares addresses the table does not wire"
