"""deploy/: Kubernetes manifests and Prometheus config agree with the platform table and are fresh."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import yaml

from forge_cli.platform import SERVICES
from forge_kit.testing.requires import missing

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
    # Trainer agents run one per GPU node (a DaemonSet); every other service is a Deployment.
    deployment = _find("DaemonSet" if spec.name == "trainer_agent" else "Deployment", name)
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


KUBERNETES_VERSION = "1.30.0"


def test_every_manifest_is_valid_kubernetes() -> None:
    import kubernetes_validate

    checked = 0
    for doc in _documents():
        if doc["kind"] == "Kustomization":
            continue
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        checked += 1
    assert checked > 20


def test_kustomization_lists_every_manifest() -> None:
    [kustomization] = [d for d in _documents() if d["kind"] == "Kustomization"]
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files


def _ingress_peers(service: str, port: int) -> list[dict[str, Any]] | None:
    """The peers admitted to ``service`` on ``port``: None when the port is open to all."""
    policy = _find("NetworkPolicy", f"{service.replace('_', '-')}-ingress")
    for rule in policy["spec"]["ingress"]:
        if any(p["port"] == port for p in rule["ports"]):
            return rule.get("from")
    return []


def test_network_policies_admit_exactly_the_table_flows() -> None:
    _find("NetworkPolicy", "default-deny-ingress")
    by_name = {s.name: s for s in SERVICES}
    public = _generator().PUBLIC_SERVICES
    for spec in SERVICES:
        for kind, port in (("grpc", spec.grpc_port), ("http", spec.http_port)):
            peers = _ingress_peers(spec.name, port)
            if kind in public.get(spec.name, ()):
                assert peers is None, f"{spec.name} {kind} should be public"
                continue
            admitted = {
                p["podSelector"]["matchLabels"]["app.kubernetes.io/name"]
                for p in peers or []
                if "podSelector" in p
            }
            expected = {
                caller.name.replace("_", "-")
                for caller in by_name.values()
                if any(c.target == spec.name and c.kind == kind for c in caller.calls)
            }
            assert admitted == expected, f"{spec.name} {kind}: {admitted} != {expected}"
            if kind == "http":
                assert any("namespaceSelector" in p for p in peers or []), (
                    f"{spec.name}: metrics not scrapeable"
                )


def test_scaled_services_have_an_autoscaler_and_keep_capacity_through_disruption() -> None:
    for name in _generator().SCALED_SERVICES:
        host = name.replace("_", "-")
        hpa = _find("HorizontalPodAutoscaler", host)
        assert hpa["spec"]["scaleTargetRef"]["name"] == host
        assert _find("Deployment", host)["spec"]["replicas"] == hpa["spec"]["minReplicas"] >= 2
        assert _find("PodDisruptionBudget", host)["spec"]["minAvailable"] == 1


def test_alerts_and_dashboard_use_only_metrics_the_services_export() -> None:
    import json
    import re

    exported = set()
    for path in [*ROOT.glob("libs/kit/src/**/*.py"), *ROOT.glob("services/*/src/**/*.py")]:
        exported |= set(re.findall(r'"((?:forge_|vllm:)[a-z_]+)"', path.read_text()))
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())["groups"][0]["rules"]
    boards = [
        json.loads(p.read_text()) for p in sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
    ]
    assert len(boards) >= 4
    expressions = [r["expr"] for r in rules]
    expressions += [t["expr"] for board in boards for p in board["panels"] for t in p["targets"]]
    used = {
        re.sub(r"_(bucket|sum|count)$", "", m)
        for expr in expressions
        for m in re.findall(r"\b(?:forge_|vllm:)[a-z_]+", expr)
    }
    # prometheus_client adds _total to counters and _bucket to histograms on the wire.
    missing = {m for m in used if m not in exported and m.removesuffix("_total") not in exported}
    assert not missing, f"alerts/dashboard reference metrics nobody exports: {missing}"


def test_mlflow_runs_on_postgres_and_the_object_store_reachable_only_by_tracking_services() -> None:
    deployment = _find("Deployment", "mlflow")
    _find("Service", "mlflow")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["env"][0]["valueFrom"]["secretKeyRef"] == {"name": "forge-databases", "key": "mlflow"}
    assert "$(MLFLOW_BACKEND_STORE_URI)" in container["command"]
    peers = _ingress_peers("mlflow", 5000) or []
    admitted = {p["podSelector"]["matchLabels"]["app.kubernetes.io/name"] for p in peers}
    assert admitted == {s.name.replace("_", "-") for s in SERVICES if s.tracking} == {"orchestrator"}
    config = _find("ConfigMap", "forge-orchestrator-config")["data"]
    assert config["FORGE_ORCHESTRATOR_MLFLOW_URI"] == "http://mlflow.forge.svc:5000"


PROMETHEUS = ROOT / "deploy" / "prometheus"


def test_alert_rules_pass_promtool_unit_tests() -> None:
    """deploy/prometheus/alerts.test.yml: each alert fires on its series and not below threshold."""
    import shutil
    import subprocess

    promtool = shutil.which("promtool")
    if promtool is None:
        missing("promtool is not installed (Debian package prometheus; `make test` installs it as root)")
    checked = subprocess.run(
        [promtool, "check", "rules", "alerts.yml"], cwd=PROMETHEUS, capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run(
        [promtool, "test", "rules", "alerts.test.yml"], cwd=PROMETHEUS, capture_output=True, text=True
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr
    tests = yaml.safe_load((PROMETHEUS / "alerts.test.yml").read_text())["tests"]
    covered = {t["alertname"] for test in tests for t in test["alert_rule_test"]}
    assert {
        "ForgeGatewayShedding",
        "ForgeServiceDown",
        "ForgeTrainingCheckpointStall",
        "ForgeRagRetrieveSlow",
    } <= covered


def test_the_dashboards_have_the_gateway_training_and_rag_panels() -> None:
    import json

    boards = {
        p.stem: json.loads(p.read_text()) for p in (ROOT / "deploy" / "grafana" / "dashboards").glob("*.json")
    }
    exprs = {
        name: " ".join(t["expr"] for p in b["panels"] for t in p["targets"]) for name, b in boards.items()
    }
    for metric in (
        "forge_gateway_time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "forge_gateway_shed_total",
        "forge_gateway_queue_wait_seconds",
    ):
        assert metric in exprs["forge-gateway"], metric
    assert "by (le, priority)" in exprs["forge-gateway"]
    for metric in ('"loss"', '"tokens_per_s"', '"mfu"', '"checkpoint_save_s"'):
        assert metric in exprs["forge-training"], metric
    for stage in ("retrieve", "rerank", "assemble"):
        assert f'stage="{stage}"' in exprs["forge-rag"], stage
    assert 'result="hit"' in exprs["forge-rag"]
    assert all(p["datasource"]["uid"] == "prometheus" for b in boards.values() for p in b["panels"])


def test_compose_monitoring_profile_is_provisioned_from_deploy() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["monitoring"]
        for volume in services[name]["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), volume
    assert services["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"].startswith(
        "${GRAFANA_ADMIN_PASSWORD:?"
    )
    datasource = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["uid"] == "prometheus"
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/forge.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
