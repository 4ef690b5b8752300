"""deploy/: Kubernetes manifests and Prometheus config agree with the platform table and are fresh."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import yaml

from forge_cli.platform import SERVICES

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"


def _generator() -> Any:
    spec = importlib.util.spec_from_file_location("forge_deploy_generate", ROOT / "deploy" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _documents() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def test_generated_files_are_up_to_date() -> None:
    stale = [
        str(p.relative_to(ROOT))
        for p, text in _generator().rendered().items()
        if not p.exists() or p.read_text() != text
    ]
    assert stale == [], f"run `.venv/bin/python deploy/generate.py` (make gen): {stale}"


def _find(kind: str, name: str) -> dict[str, Any]:
    found = [d for d in _documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def test_every_manifest_parses_and_has_kind_and_name() -> None:
    docs = _documents()
    assert docs
    for doc in docs:
        assert doc["apiVersion"] and doc["kind"] and doc["metadata"]["name"]
    assert any(d["kind"] == "Namespace" for d in docs)
    assert any(d["kind"] == "ConfigMap" for d in docs)


@pytest.mark.parametrize("spec", SERVICES, ids=lambda s: s.name)
def test_deployment_and_service_match_the_table(spec: Any) -> None:
    name = spec.name.replace("_", "-")
    deployment = _find("Deployment", name)
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": spec.grpc_port, "http": spec.http_port}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["resources"]["requests"] and container["resources"]["limits"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert (
        deployment["spec"]["selector"]["matchLabels"].items()
        <= deployment["spec"]["template"]["metadata"]["labels"].items()
    )

    service = _find("Service", name)
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        "grpc": spec.grpc_port,
        "http": spec.http_port,
    }
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]

    config = _find("ConfigMap", f"forge-{name}-config")["data"]
    assert all(k.startswith(spec.prefix) for k in config)
    assert config[f"{spec.prefix}HTTP_PORT"] == str(spec.http_port)
    secret_env = {e["name"] for e in container["env"]}
    assert f"{spec.prefix}AUTH_TOKEN" in secret_env
    assert {f"{spec.prefix}{c.target.upper()}_TOKEN" for c in spec.calls} <= secret_env


def test_prometheus_scrapes_every_service_metrics_endpoint() -> None:
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    targets = {
        t: job.get("metrics_path", "/metrics")
        for job in config["scrape_configs"]
        for static in job["static_configs"]
        for t in static["targets"]
    }
    for spec in SERVICES:
        assert targets.get(f"{spec.name.replace('_', '-')}:{spec.http_port}") == "/metrics"
