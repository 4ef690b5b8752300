"""Issue 22, hole 5: default credentials are live.

The attacker knows the source: the gateway's old bootstrap key ``forge-dev-key``, the services'
``forge-dev-token``, Compose's ``dev-token-<service>`` tokens and its constant PostgreSQL
password. None of them may open anything: ``forge up`` generates every secret (0600), a service
given a known default refuses to start, and the Compose file holds no secret and publishes ports
on loopback only.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from rich.console import Console
from typer.testing import CliRunner

from forge_cli import local, platform, secretsfile, tlscerts, tokens
from forge_cli.main import app
from forge_cli.platform import ServiceSpec
from forge_cli.supervisor import Paths
from forge_kit.testing import ServiceProcess

ROOT = Path(__file__).resolve().parents[2]
KNOWN = ["forge-dev-key", "forge-dev-token", "dev-token-inference-gateway"]
BOOTSTRAP = "inference_gateway.BOOTSTRAP_API_KEY"


def _forge_up_env(paths: Paths, name: str) -> tuple[dict[str, str], tokens.PlatformSecrets]:
    """The environment ``forge up`` gives service ``name`` (ports moved to free ones, Kafka off)."""
    table = platform.local_table(platform.SERVICES)
    secrets = tokens.load_platform(paths.tokens, paths.event_keys, paths.generated, table)
    spec = next(s for s in table if s.name == name)
    env = platform.service_env(
        spec, table, secrets.tokens, paths.root, event_keys=secrets.event_keys, generated=secrets.generated
    )
    env.update(
        {
            f"{spec.prefix}GRPC_PORT": "0",
            f"{spec.prefix}HTTP_PORT": "0",
            f"{spec.prefix}KAFKA_ENABLED": "false",
        }
    )
    return env, secrets


def _clean_environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("FORGE_")}


@pytest.mark.integration
def test_gateway_started_like_forge_up_rejects_the_old_bootstrap_key(tmp_path: Path) -> None:
    paths = Paths(tmp_path)
    env, secrets = _forge_up_env(paths, "inference_gateway")
    generated_key = secrets.generated["inference_gateway.BOOTSTRAP_API_KEY"]
    assert secrets.new == {"inference_gateway.BOOTSTRAP_API_KEY": generated_key}  # shown once...
    again = tokens.load_platform(paths.tokens, paths.event_keys, paths.generated, platform.SERVICES)
    assert (
        again.new == {} and again.generated["inference_gateway.BOOTSTRAP_API_KEY"] == generated_key
    )  # ...kept
    gateway = ServiceProcess(
        "forge_inference_gateway", env=env, cwd=str(tmp_path), log_path=str(tmp_path / "gateway.log")
    ).start(60)
    try:
        with httpx.Client(base_url=gateway.http_url, timeout=30) as client:
            for guess in (*KNOWN, "default", "forge"):
                reply = client.get("/v1/models", headers={"Authorization": f"Bearer {guess}"})
                assert reply.status_code == 401, (guess, reply.text)
            # The generated key authenticates (no model server runs here, so the listing may fail).
            reply = client.get("/v1/models", headers={"Authorization": f"Bearer {generated_key}"})
            assert reply.status_code not in (401, 403), reply.text
    finally:
        gateway.stop()


def _start_and_fail(module: str, env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module],
        env={**_clean_environ(), **env},
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.integration
@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        ("BOOTSTRAP_API_KEY", "forge-dev-key", "bootstrap_api_key is a known default secret"),
        ("AUTH_TOKEN", "forge-dev-token", "auth_token is a known default secret"),
        ("AUTH_TOKEN", "dev-token-inference-gateway", "auth_token is a known default secret"),
        ("RETRIEVER_TOKEN", "dev-token-retriever", "retriever_token is a known default secret"),
        ("AUTH_TOKEN", "", "auth_token is empty"),
    ],
)
def test_a_service_given_a_known_default_refuses_to_start(
    tmp_path: Path, setting: str, value: str, message: str
) -> None:
    env, _ = _forge_up_env(Paths(tmp_path), "inference_gateway")
    env[f"FORGE_INFERENCE_GATEWAY_{setting}"] = value
    result = _start_and_fail("forge_inference_gateway", env, tmp_path)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "inference_gateway refuses to start" in output and message in output, output[-2000:]
    assert "make secrets" in output


@pytest.mark.integration
def test_a_service_without_any_token_refuses_to_start(tmp_path: Path) -> None:
    """No ``AUTH_TOKEN`` at all: there is no default to fall back on."""
    result = _start_and_fail(
        "forge_scheduler",
        {"FORGE_SCHEDULER_DATA_DIR": str(tmp_path), "FORGE_SCHEDULER_KAFKA_ENABLED": "false"},
        tmp_path,
    )
    assert result.returncode != 0
    assert "scheduler refuses to start: auth_token is empty" in result.stdout + result.stderr


def test_forge_up_secrets_are_private(tmp_path: Path) -> None:
    paths = Paths(tmp_path)
    tokens.load_platform(paths.tokens, paths.event_keys, paths.generated, platform.SERVICES)
    assert stat.S_IMODE(paths.tokens.parent.stat().st_mode) == 0o700
    for path in (paths.tokens, paths.event_keys, paths.generated):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_every_service_gets_distinct_generated_secrets(tmp_path: Path) -> None:
    paths = Paths(tmp_path)
    secrets = tokens.load_platform(paths.tokens, paths.event_keys, paths.generated, platform.SERVICES)
    values = [*secrets.tokens.values(), *secrets.event_keys.values(), *secrets.generated.values()]
    assert len(set(values)) == len(values)
    assert not any(v in KNOWN or v.startswith("dev-token") for v in values)


# --- Compose --------------------------------------------------------------------------------------

COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SECRETISH = re.compile(r"(TOKEN|PASSWORD|PWD|SECRET|_KEY|_KEYS)$")
REFERENCE = re.compile(r"\$\{([A-Z][A-Z0-9_]*)(:?[-?+])?([^}]*)\}")


def _environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    return dict(env) if isinstance(env, dict) else dict(item.split("=", 1) for item in env)


def test_compose_holds_no_constant_secret() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    assert "dev-token" not in text and "forge-dev" not in text
    for name, service in COMPOSE["services"].items():
        for key, value in _environment(service).items():
            for variable, operator, default in REFERENCE.findall(str(value)):
                if variable != "FORGE_BIND_ADDR":
                    assert operator == ":?", f"{name}.{key} gives ${variable} a default ({operator}{default})"
            if SECRETISH.search(key) and not str(value).startswith("/etc/forge/temporal-tls/"):
                # A secret is a reference to `make secrets`' .env, or a file it wrote (TLS keys).
                assert REFERENCE.search(str(value)), f"{name}.{key} is a literal secret"


def test_compose_publishes_ports_on_loopback_only() -> None:
    published = [
        (name, str(port))
        for name, service in COMPOSE["services"].items()
        for port in service.get("ports", [])
    ]
    assert published, "nothing is published at all?"
    unauthenticated = {"temporal-ui", "mlflow", "prometheus"}
    for name, port in published:
        # What answers without authentication stays on loopback whatever FORGE_BIND_ADDR says.
        bind = "127.0.0.1:" if name in unauthenticated else "${FORGE_BIND_ADDR:-127.0.0.1}:"
        assert port.startswith(bind), (name, port)
    assert "ports" not in COMPOSE["services"]["kafka"]


def test_compose_temporal_requires_client_certificates() -> None:
    temporal = _environment(COMPOSE["services"]["temporal"])
    assert temporal["TEMPORAL_TLS_REQUIRE_CLIENT_AUTH"] == "true"
    orchestrator = _environment(COMPOSE["services"]["orchestrator"])
    assert orchestrator["FORGE_ORCHESTRATOR_TEMPORAL_TLS_CERT_FILE"].endswith("/orchestrator.pem")


def test_make_secrets_certificates_admit_only_the_forge_ca(tmp_path: Path) -> None:
    from cryptography import x509

    written = tlscerts.write(tmp_path / "tls")
    assert {p.name for p in written} >= {"ca.pem", "server.pem", "orchestrator.pem", "orchestrator.key"}
    assert stat.S_IMODE((tmp_path / "tls").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "tls" / "ca.key").stat().st_mode) == 0o600
    ca = x509.load_pem_x509_certificate((tmp_path / "tls" / "ca.pem").read_bytes())
    server = x509.load_pem_x509_certificate((tmp_path / "tls" / "server.pem").read_bytes())
    server.verify_directly_issued_by(ca)
    assert "temporal" in server.extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    ).value.get_values_for_type(x509.DNSName)
    assert tlscerts.write(tmp_path / "tls") == []  # kept on a second run


def test_orchestrator_speaks_mutual_tls_to_temporal_when_given_certificates(tmp_path: Path) -> None:
    from forge_orchestrator.config import OrchestratorSettings

    tls = tmp_path / "tls"
    tlscerts.write(tls)
    files = {
        "temporal_tls_ca_file": str(tls / "ca.pem"),
        "temporal_tls_cert_file": str(tls / "orchestrator.pem"),
        "temporal_tls_key_file": str(tls / "orchestrator.key"),
    }
    config = OrchestratorSettings(auth_token="t", temporal_tls_server_name="temporal", **files).temporal_tls()
    assert config is not None and config.client_cert == (tls / "orchestrator.pem").read_bytes()
    assert config.domain == "temporal"
    with pytest.raises(ValueError, match="missing: temporal_tls_key_file"):
        OrchestratorSettings(auth_token="t", **{**files, "temporal_tls_key_file": ""})
    assert OrchestratorSettings(auth_token="t").temporal_tls() is None  # the local dev server


def test_compose_kafka_requires_sasl_and_acls() -> None:
    kafka = _environment(COMPOSE["services"]["kafka"])
    assert kafka["KAFKA_ALLOW_EVERYONE_IF_NO_ACL_FOUND"] == "false"
    listeners = dict(item.split(":", 1) for item in kafka["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))
    for listener in kafka["KAFKA_LISTENERS"].split(","):
        name, address = listener.split("://", 1)
        # Only the SASL listener is reachable from other containers; the rest is loopback.
        assert listeners[name] == "SASL_PLAINTEXT" or address.startswith("127.0.0.1:"), listener
    spec: ServiceSpec
    for spec in platform.SERVICES:
        env = _environment(COMPOSE["services"][spec.name.replace("_", "-")])
        assert env[f"{spec.prefix}KAFKA_SECURITY_PROTOCOL"] == "SASL_PLAINTEXT"
        assert env[f"{spec.prefix}KAFKA_SASL_USERNAME"] == spec.service


def test_make_secrets_writes_a_private_env_file_covering_every_reference(tmp_path: Path) -> None:
    env_file = tmp_path / ".env"
    shown = secretsfile.write(env_file)
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    values = secretsfile.read(env_file)
    text = (ROOT / "docker-compose.yml").read_text()
    referenced = {v for v, op, _ in REFERENCE.findall(text) if op == ":?"}
    assert referenced <= set(values), referenced - set(values)
    assert list(shown) == ["FORGE_SECRET_INFERENCE_GATEWAY_BOOTSTRAP_API_KEY"]
    assert secretsfile.write(env_file) == {}  # shown once; kept afterwards
    assert secretsfile.read(env_file) == values
    assert ".env" in (ROOT / ".gitignore").read_text().splitlines()


def test_forge_up_never_prints_the_bootstrap_key_and_forge_keys_shows_it(tmp_path: Path) -> None:
    """The key lands in a 0600 file, not in terminal scrollback or CI logs; ``forge keys show``
    prints it (alone) on request, and only to whoever can read that file."""
    paths = Paths(tmp_path)
    secrets = tokens.load_platform(paths.tokens, paths.event_keys, paths.generated, platform.SERVICES)
    key = secrets.generated[BOOTSTRAP]
    console = Console(record=True, width=300)
    local.announce_generated(console, secrets.new, paths.generated)
    said = console.export_text()
    assert BOOTSTRAP in said and "forge keys show" in said and key not in said
    assert stat.S_IMODE(paths.generated.stat().st_mode) == 0o600

    env = {**_clean_environ(), "FORGE_ROOT": str(tmp_path)}
    shown = CliRunner().invoke(app, ["keys", "show"], env=env)
    assert shown.exit_code == 0 and shown.stdout.strip() == key, shown.output
    listed = CliRunner().invoke(app, ["keys", "list"], env=env)
    assert listed.exit_code == 0 and listed.stdout.split() == [BOOTSTRAP] and key not in listed.output
    missing = CliRunner().invoke(app, ["keys", "show", "nope.X"], env=env)
    assert missing.exit_code == 1 and key not in missing.output
    # make secrets (Compose) names the generated key without printing it either.
    env_file = tmp_path / "compose" / ".env"
    env_file.parent.mkdir()
    run = subprocess.run(
        [sys.executable, "-m", "forge_cli.secretsfile", str(env_file)],
        capture_output=True,
        text=True,
        check=True,
        env=_clean_environ(),
    )
    written = secretsfile.read(env_file)
    gateway = next(s for s in platform.SERVICES if s.name == "inference_gateway")
    value = written[secretsfile.generated_var(gateway, "BOOTSTRAP_API_KEY")]
    assert value and value not in run.stdout and "generated" in run.stdout
