"""docker-compose.yml, checked without a Docker engine: the Compose schema plus Forge's own rules."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from forge_cli import secretsfile
from forge_cli.platform import SERVICES

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
SCHEMA = ROOT / "deploy" / "compose" / "compose-spec.json"
FORGE = {s.name.replace("_", "-"): s for s in SERVICES}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def test_matches_the_compose_specification_schema(compose: dict[str, Any]) -> None:
    validator = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(compose)]
    assert errors == []


def test_the_schema_check_catches_a_bad_file(compose: dict[str, Any]) -> None:
    validator = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))
    broken = {
        **compose,
        "services": {**compose["services"], "x": {"image": "a", "depends_on": {"y": {"condition": "maybe"}}}},
    }
    assert list(validator.iter_errors(broken))


def test_infrastructure_and_every_service_are_present(compose: dict[str, Any]) -> None:
    names = set(compose["services"])
    assert {"postgres", "redis", "kafka", "temporal", "temporal-ui", "qdrant"} <= names
    assert set(FORGE) <= names
    assert "KAFKA_PROCESS_ROLES" in compose["services"]["kafka"]["environment"]  # KRaft, no ZooKeeper


def test_every_service_has_an_image_or_build_and_a_healthcheck(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        assert "image" in service or "build" in service, name
        assert service.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"


def test_dependencies_exist_and_wait_for_health(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, service in services.items():
        for dep, cond in service.get("depends_on", {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            assert cond == {"condition": "service_healthy"}, f"{name} -> {dep}"
    for name, spec in FORGE.items():
        deps = set(services[name]["depends_on"])
        assert {"postgres", "redis", "kafka"} <= deps
        assert {c.target.replace("_", "-") for c in spec.calls} <= deps


def test_forge_services_build_from_their_dockerfile_as_non_root(compose: dict[str, Any]) -> None:
    for name, spec in FORGE.items():
        service = compose["services"][name]
        assert service["build"]["context"] == "."
        dockerfile = ROOT / service["build"]["dockerfile"]
        assert dockerfile == ROOT / "services" / spec.name / "Dockerfile" and dockerfile.exists()
        text = dockerfile.read_text()
        users = re.findall(r"^USER\s+(\S+)", text, flags=re.M)
        assert users and not users[-1].startswith(("root", "0")), f"{dockerfile} runs as root"
        assert "HEALTHCHECK" in text and f"forge_{spec.name}" in text
        assert "COPY libs/kit" in text and "COPY libs/protos" in text
        assert service["user"].split(":")[0] not in ("0", "root")


def test_forge_service_settings_use_their_own_prefix_and_compose_names(compose: dict[str, Any]) -> None:
    for name, spec in FORGE.items():
        env = compose["services"][name]["environment"]
        assert all(key.startswith(spec.prefix) for key in env), name
        assert env[f"{spec.prefix}KAFKA_BOOTSTRAP"] == "kafka:9092"
        assert env[f"{spec.prefix}DATABASE_URL"].startswith("postgresql+asyncpg://")
        assert env[f"{spec.prefix}REDIS_URL"].startswith("redis://redis:")
        assert env[f"{spec.prefix}HTTP_PORT"] == str(spec.http_port)
        for call in spec.calls:
            callee = call.target.upper()
            key = f"{spec.prefix}{callee}_TARGET" if call.kind == "grpc" else f"{spec.prefix}{callee}_URL"
            assert call.target.replace("_", "-") in env[key]
            assert f"{spec.prefix}{callee}_TOKEN" in env


def test_one_database_per_service_is_created() -> None:
    sql = (ROOT / "deploy" / "postgres" / "init.sql").read_text()
    for spec in SERVICES:
        assert f"CREATE DATABASE forge_{spec.name};" in sql


def _compose_binary() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


def test_docker_compose_config_accepts_the_file(tmp_path: Path) -> None:
    binary = _compose_binary()
    if binary is None:
        pytest.skip(
            "neither `docker compose` nor `docker-compose` is installed; the schema test covers the file"
        )
    env_file = tmp_path / ".env"
    secretsfile.write(env_file)  # what `make secrets` writes: Compose refuses to run without it
    result = subprocess.run(
        [*binary, "-f", str(COMPOSE), "--env-file", str(env_file), "config", "-q"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def test_mlflow_runs_on_postgres_and_the_object_store_for_the_tracking_services(
    compose: dict[str, Any],
) -> None:
    services = compose["services"]
    mlflow = services["mlflow"]
    command = mlflow["command"]
    assert command[command.index("--backend-store-uri") + 1].endswith("@postgres:5432/forge_mlflow")
    assert command[command.index("--artifacts-destination") + 1].startswith("/var/lib/forge/objects/")
    assert any(v.startswith("objects:") for v in mlflow["volumes"])
    # Unauthenticated UIs are published on loopback only, whatever FORGE_BIND_ADDR says.
    assert mlflow["ports"] == ["127.0.0.1:8060:5000"]
    assert "CREATE DATABASE forge_mlflow;" in (ROOT / "deploy" / "postgres" / "init.sql").read_text()
    for name, spec in FORGE.items():
        env = services[name]["environment"]
        if spec.tracking:
            assert env[f"{spec.prefix}MLFLOW_URI"] == "http://mlflow:5000"
            assert "mlflow" in services[name]["depends_on"]
        else:
            assert f"{spec.prefix}MLFLOW_URI" not in env
