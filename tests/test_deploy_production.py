"""The production wiring, checked statically: GPU workloads request GPUs, promotions roll vLLM
replicas in the GPU profile (Compose override and Kubernetes overlay), the retriever indexes into the
Qdrant server, and ``forge up --profile prod-like`` gives services the environment Compose does."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import qdrant_client
import yaml

from forge_cli import platform, profiles
from forge_cli.platform import SERVICES
from forge_kit.eventauth import EventSigner

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_GPU = ROOT / "docker-compose.gpu.yml"
K8S = ROOT / "deploy" / "k8s"
K8S_GPU = ROOT / "deploy" / "k8s-gpu"
GATEWAY = platform.select(["inference_gateway"])[0]
RETRIEVER = platform.select(["retriever"])[0]


def _yaml(path: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(path.read_text())
    return loaded


def _documents(folder: Path) -> list[dict[str, Any]]:
    return [d for p in sorted(folder.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


def _merge(base: Any, override: Any) -> Any:
    """Compose's merge of an override file: mappings merge key by key, anything else is replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        return {k: _merge(base[k], v) if k in base else v for k, v in override.items()} | {
            k: v for k, v in base.items() if k not in override
        }
    return override


@pytest.fixture(scope="module")
def gpu_compose() -> dict[str, Any]:
    return _merge(_yaml(COMPOSE), _yaml(COMPOSE_GPU))


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    containers: list[dict[str, Any]] = doc["spec"]["template"]["spec"]["containers"]
    return containers


# --- GPUs ---------------------------------------------------------------------------------------


def test_the_gpu_override_is_valid_compose_and_every_gpu_workload_reserves_gpus(
    gpu_compose: dict[str, Any],
) -> None:
    schema = json.loads((ROOT / "deploy" / "compose" / "compose-spec.json").read_text())
    for document in (_yaml(COMPOSE_GPU), gpu_compose):
        errors = [e.message for e in jsonschema.Draft7Validator(schema).iter_errors(document)]
        assert errors == []
    devices = gpu_compose["services"]["trainer-agent"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    agent = gpu_compose["services"]["trainer-agent"]
    assert agent["build"]["args"]["TORCH_VARIANT"].startswith("cu") and agent["image"].endswith("-cuda")
    assert agent["build"]["dockerfile"] == "services/trainer_agent/Dockerfile"  # merged with the base
    # The base file stays CPU-only: nothing in it asks for a device.
    assert "deploy" not in _yaml(COMPOSE)["services"]["trainer-agent"]


def test_images_choose_cpu_or_cuda_torch_by_build_argument() -> None:
    for name in ("trainer_agent", "model_server"):
        text = (ROOT / "services" / name / "Dockerfile").read_text()
        assert "ARG TORCH_VARIANT=cpu" in text
        assert "download.pytorch.org/whl/${TORCH_VARIANT}" in text
        assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in text  # NVML needs "utility"


def test_every_kubernetes_gpu_workload_requests_gpus_and_tolerates_gpu_nodes() -> None:
    gpu_docs = [*_documents(K8S), *_documents(K8S_GPU)]
    workloads = [d for d in gpu_docs if d["kind"] in ("Deployment", "DaemonSet", "StatefulSet")]
    requesting = {
        d["metadata"]["name"]
        for d in workloads
        if any("nvidia.com/gpu" in c["resources"].get("limits", {}) for c in _containers(d))
    }
    assert requesting == {"trainer-agent"}
    for doc in workloads:
        if doc["metadata"]["name"] not in requesting:
            continue
        [container] = _containers(doc)
        resources = container["resources"]
        assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"]
        tolerations = doc["spec"]["template"]["spec"]["tolerations"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations


def test_trainer_agents_run_one_per_gpu_node_and_advertise_their_pod_address() -> None:
    [agent] = [d for d in _documents(K8S) if d["kind"] == "DaemonSet"]
    pod = agent["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    [container] = pod["containers"]
    assert container["image"].endswith("-cuda")
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in container["env"]}
    assert env["FORGE_TRAINER_AGENT_NODE_NAME"] == "spec.nodeName"
    assert env["FORGE_TRAINER_AGENT_ADVERTISE_ADDRESS"] == "status.podIP"
    # Multi-node jobs talk between agent pods (c10d rendezvous, NCCL): a policy admits exactly that.
    [peers] = [d for d in _documents(K8S) if d["metadata"]["name"] == "trainer-agent-peers"]
    selector = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "trainer-agent"}}}
    assert peers["spec"]["podSelector"] == selector["podSelector"]
    assert peers["spec"]["ingress"] == [{"from": [selector]}]


# --- GPU serving ----------------------------------------------------------------------------------


def _serving(settings: dict[str, str], gpu_type: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """How an orchestrator given the ``PROMOTE_DEPLOY*`` variables of ``settings`` deploys a
    promoted version (its settings read from the environment, as in a container)."""
    from forge_orchestrator.config import OrchestratorSettings
    from forge_orchestrator.deploy.promotion import promotion_serving

    for key, value in settings.items():
        if key.startswith("FORGE_ORCHESTRATOR_PROMOTE_DEPLOY"):
            monkeypatch.setenv(key, value)
    monkeypatch.setenv("FORGE_ORCHESTRATOR_PROMOTE_DEPLOY_GPU_TYPE", gpu_type)
    return promotion_serving(OrchestratorSettings())


def test_the_gpu_profile_serves_promotions_on_vllm_replicas_the_scheduler_places(
    gpu_compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    services = gpu_compose["services"]
    # No fixed vLLM server: promotions roll replicas on the agents' GPUs.
    assert "vllm" not in services
    env = services["orchestrator"]["environment"]
    assert env["FORGE_ORCHESTRATOR_PROMOTE_DEPLOY_GPU_TYPE"] == "${FORGE_SERVING_GPU_TYPE:-H100}"
    serving = _serving(env, "H100", monkeypatch)
    assert serving is not None
    assert (serving.engine, serving.team, serving.gpu_type) == ("vllm", "serving", "H100")
    assert serving.replicas == 1 < serving.max_replicas  # autoscaled on the gateway's queue signal
    # The replicas start from the agent's own vLLM, reachable where the agent says they are.
    assert env["FORGE_ORCHESTRATOR_DEPLOY_VLLM_PYTHON"] == "/opt/vllm/bin/python"
    assert services["trainer-agent"]["ipc"] == "host"
    # Without the override promotions roll nothing, and the gateway keeps the CPU model server.
    base = _yaml(COMPOSE)["services"]
    assert "FORGE_ORCHESTRATOR_PROMOTE_DEPLOY" not in base["orchestrator"]["environment"]
    gateway = services["inference-gateway"]["environment"]
    assert gateway["FORGE_INFERENCE_GATEWAY_MODEL_SERVER_URL"] == "http://model-server:8000"


def test_the_kubernetes_gpu_overlay_validates_and_turns_promotions_into_vllm_deployments(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kubernetes_validate

    docs = _documents(K8S_GPU)
    for doc in docs:
        if doc["kind"] != "Kustomization":
            kubernetes_validate.validate(doc, "1.30.0", strict=True)
    [kustomization] = [d for d in docs if d["kind"] == "Kustomization"]
    assert kustomization["resources"] == ["../k8s"]
    [patch] = [d for d in docs if d["kind"] == "ConfigMap"]
    assert patch["metadata"]["name"] == "forge-orchestrator-config"
    gpu_type = patch["data"]["FORGE_ORCHESTRATOR_PROMOTE_DEPLOY_GPU_TYPE"]
    serving = _serving(patch["data"], gpu_type, monkeypatch)
    assert serving is not None and (serving.engine, serving.gpu_type) == ("vllm", gpu_type)
    assert serving.replicas < serving.max_replicas
    # Replicas are scheduler jobs on the agents, not pods: no workload of the overlay's own.
    assert not [d for d in docs if d["kind"] in ("Deployment", "HorizontalPodAutoscaler")]
    # The model servers' autoscaler still reads vLLM's queue through Prometheus Adapter.
    rules = _yaml(ROOT / "deploy" / "prometheus" / "adapter-rules.yaml")["rules"]["custom"]
    assert [r["name"]["as"] for r in rules] == ["vllm_num_requests_waiting"]
    assert rules[0]["seriesQuery"].startswith("vllm:num_requests_waiting")


def test_kustomize_builds_the_gpu_overlay_with_the_orchestrator_deploying_promotions() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed; the overlay's files are checked one by one above")
    built = subprocess.run([kubectl, "kustomize", str(K8S_GPU)], capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    docs = [d for d in yaml.safe_load_all(built.stdout) if d]
    [config] = [
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "forge-orchestrator-config"
    ]
    assert config["data"]["FORGE_ORCHESTRATOR_PROMOTE_DEPLOY"] == "true"
    assert config["data"]["FORGE_ORCHESTRATOR_DEPLOY_VLLM_PYTHON"] == "/opt/vllm/bin/python"  # merged
    assert {d["metadata"]["name"] for d in docs if d["kind"] == "StatefulSet"} == {"qdrant"}


# --- Qdrant ---------------------------------------------------------------------------------------


def test_the_retriever_indexes_into_the_qdrant_server_in_compose_and_kubernetes() -> None:
    compose = _yaml(COMPOSE)["services"]
    env = compose["retriever"]["environment"]
    assert (env["FORGE_RETRIEVER_INDEX_BACKEND"], env["FORGE_RETRIEVER_QDRANT_URL"]) == (
        "qdrant",
        "http://qdrant:6333",
    )
    assert compose["retriever"]["depends_on"]["qdrant"] == {"condition": "service_healthy"}
    docs = _documents(K8S)
    [config] = [d for d in docs if d["metadata"]["name"] == "forge-retriever-config"]
    data = config["data"]
    assert data["FORGE_RETRIEVER_QDRANT_URL"] == "http://qdrant.forge.svc:6333"
    assert (data["FORGE_RETRIEVER_QDRANT_SHARDS"], data["FORGE_RETRIEVER_QDRANT_REPLICATION_FACTOR"]) == (
        "12",
        "2",
    )
    assert data["FORGE_RETRIEVER_QDRANT_QUANTIZATION"] == "int8"
    [qdrant] = [d for d in docs if d["kind"] == "StatefulSet"]
    assert qdrant["spec"]["replicas"] >= int(data["FORGE_RETRIEVER_QDRANT_REPLICATION_FACTOR"])
    [retriever] = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "retriever"]
    assert retriever["spec"]["replicas"] >= 2  # no in-process index pins it to one replica any more
    keys = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in _containers(retriever)[0]["env"]}
    assert keys["FORGE_RETRIEVER_QDRANT_API_KEY"] == {"name": "forge-qdrant", "key": "api-key"}


def test_the_qdrant_image_is_a_server_release_the_pinned_client_accepts() -> None:
    """qdrant-client refuses servers more than one minor version away from its own."""
    image = _yaml(COMPOSE)["services"]["qdrant"]["image"]
    server = image.split(":v")[1].split("-")[0].split(".")
    client = qdrant_client.__version__ if hasattr(qdrant_client, "__version__") else None
    if client is None:
        from importlib.metadata import version

        client = version("qdrant-client")
    major, minor = client.split(".")[:2]
    assert server[0] == major and abs(int(server[1]) - int(minor)) <= 1, (image, client)
    [statefulset] = [d for d in _documents(K8S) if d["kind"] == "StatefulSet"]
    assert _containers(statefulset)[0]["image"] == f"{image}-unprivileged"


# --- one source for Compose and `forge up --profile prod-like` -------------------------------------


@pytest.mark.parametrize("spec", SERVICES, ids=lambda s: s.name)
def test_prod_like_gives_every_service_the_settings_compose_gives_it(
    spec: platform.ServiceSpec, tmp_path: Path
) -> None:
    """Same keys (but the containers' listen address and the broker's and Temporal's transport
    security, which the local stand-ins lack), and the same values wherever a value is not an
    address: the database, Redis and Qdrant settings come from platform.production_env for both."""
    compose_env = _yaml(COMPOSE)["services"][spec.name.replace("_", "-")]["environment"]
    profile = profiles.resolve("prod-like", tmp_path, env={})
    assert profile.backing is not None
    row = profile.table([spec])[0]
    local = platform.service_env(
        row,
        profile.table(SERVICES),
        {s.name: "t" for s in SERVICES},
        profile.root,
        profile.infra,
        event_keys={s.service: EventSigner.generate(s.service).secret() for s in SERVICES},
        generated={platform.generated_name(s, g): "g" for s in SERVICES for g in s.generated},
    )
    local |= {f"{spec.prefix}{k}": v for k, v in platform.production_env(row, profile.backing).items()}

    def bare(keys: Any) -> set[str]:
        return {k.removeprefix(spec.prefix) for k in keys}

    # `local` settings only `forge up` has (a local value of a setting every deployment has, as
    # the gateway's empty MODEL_SERVER_URL, stays).
    local_only = {k.upper() for k in spec.local} - set(
        platform.declared_keys(dataclasses.replace(spec, local={}))
    )
    assert bare(compose_env) - platform.CONTAINER_ONLY == bare(local) - local_only
    same = [k for k in spec.production if "{" not in spec.production[k]]
    for key in same:
        assert compose_env[spec.prefix + key] == local[spec.prefix + key]
    assert (
        local[f"{spec.prefix}DATABASE_URL"]
        == f"postgresql+asyncpg://postgres@127.0.0.1:5432/prodlike_forge_{spec.name}"
    )
    assert local[f"{spec.prefix}REDIS_URL"] == "redis://127.0.0.1:6379/2"
    assert int(local[f"{spec.prefix}HTTP_PORT"]) == spec.http_port + profiles.PROD_LIKE_PORT_OFFSET


def test_prod_like_refuses_malformed_backing_addresses(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="FORGE_PROD_LIKE_POSTGRES"):
        profiles.resolve("prod-like", tmp_path, env={"FORGE_PROD_LIKE_POSTGRES": "x;DROP DATABASE y"})
    with pytest.raises(ValueError, match="FORGE_PROD_LIKE_REDIS_URL"):
        profiles.resolve("prod-like", tmp_path, env={"FORGE_PROD_LIKE_REDIS_URL": "http://redis"})
    with pytest.raises(ValueError, match="unknown profile"):
        profiles.resolve("staging", tmp_path)
    assert profiles.resolve("prod-like", tmp_path, env={}).root == tmp_path / "var" / "prod-like"


def test_make_secrets_fills_every_variable_the_compose_files_require(tmp_path: Path) -> None:
    """Compose stops on an unset ``${VAR:?…}``: `make secrets` must write each one, GPU profile
    and monitoring profile included."""
    import re

    from forge_cli import secretsfile

    secretsfile.write(tmp_path / ".env")
    written = set(secretsfile.read(tmp_path / ".env"))
    required = {
        name
        for path in (COMPOSE, COMPOSE_GPU)
        for name in re.findall(r"\$\{([A-Z0-9_]+):\?", path.read_text())
    }
    assert {"GRAFANA_ADMIN_PASSWORD", "FORGE_TOKEN_MODEL_SERVER", "POSTGRES_PASSWORD"} <= required
    assert required - written == set()
