"""The Kubernetes manifests: namespace, storage, per-service config, Deployments and Services,
MLflow, network policies, disruption budgets and autoscalers."""

from __future__ import annotations

from typing import Any

from forge_cli.platform import SERVICES, Backing, ServiceSpec

from . import gpu, qdrant
from .common import (
    DATA_ROOT,
    IMAGE_TAG,
    MLFLOW_K8S_URL,
    MLFLOW_PORT,
    NAMESPACE,
    QDRANT_K8S_URL,
    TLS_DIR,
    TORCH_SERVICES,
    UID,
    by_name,
    host,
    mlflow_command,
    service_settings,
    temporal_tls_settings,
    token_keys,
)


def k8s_manifests() -> dict[str, list[dict[str, Any]]]:
    """File name -> documents."""
    files: dict[str, list[dict[str, Any]]] = {
        "namespace.yaml": [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}],
        "storage.yaml": [
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": "forge-objects", "namespace": NAMESPACE},
                # Checkpoints and datasets; production points OBJECT_STORE_URL at S3 instead.
                "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "100Gi"}}},
            }
        ],
    }
    configmaps = []
    for spec in SERVICES:
        settings = service_settings(
            spec,
            kafka="kafka.forge.svc:9092",
            temporal="temporal-frontend.forge.svc:7233",
            mlflow=MLFLOW_K8S_URL,
            backing=Backing(
                database_url=None,  # from the forge-databases Secret: it carries a password
                redis_url="redis://redis.forge.svc:6379/0",
                qdrant_url=QDRANT_K8S_URL,
                qdrant_shards=qdrant.K8S_LAYOUT["shards"],
                qdrant_replicas=qdrant.K8S_LAYOUT["replication_factor"],
            ),
            kafka_protocol="SASL_SSL",
        )
        if spec.temporal:
            settings.update(temporal_tls_settings(spec, "orchestrator"))
        configmaps.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {
                    "name": f"forge-{host(spec)}-config",
                    "namespace": NAMESPACE,
                    "labels": _labels(spec),
                },
                "data": settings,
            }
        )
    files["configmap.yaml"] = configmaps
    for spec in SERVICES:
        workload = _deployment(spec)
        if spec.name == "trainer_agent":
            workload = gpu.agent_daemonset(workload, spec)  # one agent per GPU node
        files[f"{host(spec)}.yaml"] = [workload, _service(spec)]
    files["mlflow.yaml"] = mlflow_manifests()
    files["qdrant.yaml"] = qdrant.k8s_manifests()
    files["network-policies.yaml"] = network_policies()
    files["disruption-budgets.yaml"] = [_disruption_budget(spec) for spec in SERVICES]
    files["autoscaling.yaml"] = autoscalers()
    files["kustomization.yaml"] = [
        {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "metadata": {"name": "forge"},
            "namespace": NAMESPACE,
            "resources": sorted(name for name in files if name != "kustomization.yaml"),
        }
    ]
    return files


#: Services people and product apps reach from outside the namespace (through an ingress or a
#: port-forward): the public inference API, the rater UI, and the gRPC APIs researchers' CLIs
#: call. Everything else is reachable only from the callers the platform table names.
PUBLIC_SERVICES = {
    "inference_gateway": ("grpc", "http"),
    "preference_feedback": ("http",),
    "scheduler": ("grpc",),
    "orchestrator": ("grpc",),
    "eval": ("grpc",),
}
#: Pods allowed to scrape every service's metrics port.
MONITORING_SELECTOR = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}


def callers_of(name: str) -> list[ServiceSpec]:
    """Services whose table row calls ``name``."""
    return [spec for spec in SERVICES if any(call.target == name for call in spec.calls)]


def network_policies() -> list[dict[str, Any]]:
    """Default-deny ingress, then one policy per service admitting exactly the flows in the
    platform table (callers on the port kind they use), monitoring on the HTTP port, and the
    public entry points. Egress stays open: brokers, databases and object stores live outside."""
    policies: list[dict[str, Any]] = [
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "default-deny-ingress", "namespace": NAMESPACE},
            "spec": {"podSelector": {}, "policyTypes": ["Ingress"]},
        }
    ]
    for spec in SERVICES:
        rules: list[dict[str, Any]] = []
        for kind in ("grpc", "http"):
            port = spec.grpc_port if kind == "grpc" else spec.http_port
            peers = [
                {"podSelector": {"matchLabels": {"app.kubernetes.io/name": host(caller)}}}
                for caller in callers_of(spec.name)
                if any(call.target == spec.name and call.kind == kind for call in caller.calls)
            ]
            if kind in PUBLIC_SERVICES.get(spec.name, ()):
                rules.append({"ports": [{"port": port, "protocol": "TCP"}]})
                continue
            if kind == "http":
                peers.append(MONITORING_SELECTOR)
            if peers:
                rules.append({"from": peers, "ports": [{"port": port, "protocol": "TCP"}]})
        policies.append(
            {
                "apiVersion": "networking.k8s.io/v1",
                "kind": "NetworkPolicy",
                "metadata": {
                    "name": f"{host(spec)}-ingress",
                    "namespace": NAMESPACE,
                    "labels": _labels(spec),
                },
                "spec": {
                    "podSelector": {"matchLabels": {"app.kubernetes.io/name": host(spec)}},
                    "policyTypes": ["Ingress"],
                    "ingress": rules,
                },
            }
        )
    trackers = [
        {"podSelector": {"matchLabels": {"app.kubernetes.io/name": host(spec)}}}
        for spec in SERVICES
        if spec.tracking
    ]
    policies.append(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "mlflow-ingress", "namespace": NAMESPACE, "labels": MLFLOW_LABELS},
            "spec": {
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "mlflow"}},
                "policyTypes": ["Ingress"],
                # The services that record runs; people reach the UI through a port-forward.
                "ingress": [{"from": trackers, "ports": [{"port": MLFLOW_PORT, "protocol": "TCP"}]}],
            },
        }
    )
    policies.append(qdrant.network_policy(MONITORING_SELECTOR))
    policies.append(gpu.agent_peer_policy(by_name()["trainer_agent"]))
    policies.append(replica_policy())
    return policies


#: Where a serving replica listens on an agent's pod: a port the agent asks the kernel for (Linux's
#: default ``net.ipv4.ip_local_port_range``).
REPLICA_PORTS = (32768, 60999)


def replica_policy() -> dict[str, Any]:
    """The serving replicas agents start: the gateway routes to them and the orchestrator checks
    their health (``/v1/models``), on the port the agent assigned; monitoring scrapes them."""
    agent = by_name()["trainer_agent"]
    first, last = REPLICA_PORTS
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": f"{host(agent)}-replicas", "namespace": NAMESPACE, "labels": _labels(agent)},
        "spec": {
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": host(agent)}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [
                        *(
                            {
                                "podSelector": {
                                    "matchLabels": {"app.kubernetes.io/name": host(by_name()[name])}
                                }
                            }
                            for name in ("inference_gateway", "orchestrator")
                        ),
                        MONITORING_SELECTOR,
                    ],
                    "ports": [{"port": first, "endPort": last, "protocol": "TCP"}],
                }
            ],
        },
    }


MLFLOW_LABELS = {"app.kubernetes.io/name": "mlflow", "app.kubernetes.io/part-of": "forge"}


def mlflow_manifests() -> list[dict[str, Any]]:
    """The tracking server: runs in PostgreSQL (URL from the ``forge-databases`` Secret, key
    ``mlflow``), artifacts on the shared object store volume."""
    command = mlflow_command(
        "$(MLFLOW_BACKEND_STORE_URI)",
        ("mlflow", f"mlflow.{NAMESPACE}.svc", f"mlflow.{NAMESPACE}.svc:{MLFLOW_PORT}", "localhost:*"),
    )
    probe = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10, "timeoutSeconds": 3}
    container = {
        "name": "mlflow",
        "image": f"forge/mlflow:{IMAGE_TAG}",
        "command": command,
        "ports": [{"name": "http", "containerPort": MLFLOW_PORT}],
        "env": [
            {
                "name": "MLFLOW_BACKEND_STORE_URI",
                "valueFrom": {"secretKeyRef": {"name": "forge-databases", "key": "mlflow"}},
            }
        ],
        "readinessProbe": {**probe, "initialDelaySeconds": 10},
        "livenessProbe": {**probe, "initialDelaySeconds": 30, "failureThreshold": 3},
        "resources": {
            "requests": {"cpu": "100m", "memory": "512Mi"},
            "limits": {"cpu": "1", "memory": "2Gi"},
        },
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "objects", "mountPath": f"{DATA_ROOT}/objects"},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "mlflow", "namespace": NAMESPACE, "labels": MLFLOW_LABELS},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app.kubernetes.io/name": "mlflow"}},
            "template": {
                "metadata": {"labels": MLFLOW_LABELS},
                "spec": {
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": UID,
                        "runAsGroup": UID,
                        "fsGroup": UID,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [container],
                    "volumes": [
                        {"name": "objects", "persistentVolumeClaim": {"claimName": "forge-objects"}},
                        {"name": "tmp", "emptyDir": {}},
                    ],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "mlflow", "namespace": NAMESPACE, "labels": MLFLOW_LABELS},
        "spec": {
            "selector": {"app.kubernetes.io/name": "mlflow"},
            "ports": [{"name": "http", "port": MLFLOW_PORT, "targetPort": "http"}],
        },
    }
    return [deployment, service]


def _disruption_budget(spec: ServiceSpec) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": host(spec), "namespace": NAMESPACE, "labels": _labels(spec)},
        # Serving keeps capacity through a voluntary disruption; the rest may restart one at a time.
        "spec": {
            **({"minAvailable": 1} if spec.name in SCALED_SERVICES else {"maxUnavailable": 1}),
            "selector": {"matchLabels": {"app.kubernetes.io/name": host(spec)}},
        },
    }


#: Serving tiers that scale horizontally: name -> (min, max, metric).
SCALED_SERVICES: dict[str, tuple[int, int, dict[str, Any]]] = {
    # The gateway is CPU-bound (auth, routing, SSE relay).
    "inference_gateway": (
        2,
        10,
        {
            "type": "Resource",
            "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 70}},
        },
    ),
    # The retriever keeps no index of its own on the Qdrant server backend: replicas share the
    # Qdrant cluster, and embedding queries is CPU work.
    "retriever": (
        2,
        8,
        {
            "type": "Resource",
            "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 70}},
        },
    ),
    # Model servers scale on queue depth (vLLM's metric name, exported by model_server and vLLM
    # alike; Prometheus Adapter exposes it as a pods metric without the colon).
    "model_server": (
        2,
        16,
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "vllm_num_requests_waiting"},
                "target": {"type": "AverageValue", "averageValue": "4"},
            },
        },
    ),
}


def autoscalers() -> list[dict[str, Any]]:
    return [
        {
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": host(name), "namespace": NAMESPACE, "labels": _labels(by_name()[name])},
            "spec": {
                "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": host(name)},
                "minReplicas": low,
                "maxReplicas": high,
                "metrics": [metric],
            },
        }
        for name, (low, high, metric) in SCALED_SERVICES.items()
    ]


def _labels(spec: ServiceSpec) -> dict[str, str]:
    return {"app.kubernetes.io/name": host(spec), "app.kubernetes.io/part-of": "forge"}


def _deployment(spec: ServiceSpec) -> dict[str, Any]:
    env: list[dict[str, Any]] = [
        {"name": key, "valueFrom": {"secretKeyRef": {"name": "forge-tokens", "key": owner}}}
        for key, owner in token_keys(spec).items()
    ]
    secret_refs = {
        f"{spec.prefix}DATABASE_URL": ("forge-databases", spec.name),
        f"{spec.prefix}EVENT_SIGNING_KEY": ("forge-event-keys", spec.service),
        f"{spec.prefix}EVENT_VERIFY_KEYS": ("forge-event-keys", "verify-keys"),
        f"{spec.prefix}KAFKA_SASL_PASSWORD": ("forge-kafka-users", spec.service),
        **(
            {f"{spec.prefix}QDRANT_API_KEY": qdrant.API_KEY_SECRET} if "QDRANT_URL" in spec.production else {}
        ),
        **{
            f"{spec.prefix}{s.upper()}": ("forge-generated", f"{spec.service}.{s.upper()}")
            for s in spec.generated
        },
    }
    env += [
        {"name": key, "valueFrom": {"secretKeyRef": {"name": secret, "key": item}}}
        for key, (secret, item) in secret_refs.items()
    ]
    heavy = spec.name in TORCH_SERVICES
    probe = {"periodSeconds": 10, "timeoutSeconds": 3}
    container = {
        "name": host(spec),
        "image": f"forge/{host(spec)}:{IMAGE_TAG}",
        "ports": [
            {"name": "grpc", "containerPort": spec.grpc_port},
            {"name": "http", "containerPort": spec.http_port},
        ],
        "envFrom": [{"configMapRef": {"name": f"forge-{host(spec)}-config"}}],
        "env": env,
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "http"}, "initialDelaySeconds": 5, **probe},
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": "http"},
            "initialDelaySeconds": 20,
            "failureThreshold": 3,
            **probe,
        },
        "resources": {
            "requests": {"cpu": "500m" if heavy else "100m", "memory": "2Gi" if heavy else "256Mi"},
            "limits": {"cpu": "4" if heavy else "1", "memory": "8Gi" if heavy else "1Gi"},
        },
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "data", "mountPath": f"{DATA_ROOT}/data"},
            {"name": "objects", "mountPath": f"{DATA_ROOT}/objects"},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    volumes: list[dict[str, Any]] = [
        {"name": "data", "emptyDir": {}},
        {"name": "objects", "persistentVolumeClaim": {"claimName": "forge-objects"}},
        {"name": "tmp", "emptyDir": {}},
    ]
    if spec.temporal:
        # Temporal's mutual TLS: the CA and this client's pair, from a Secret never committed.
        container["volumeMounts"].append({"name": "temporal-tls", "mountPath": TLS_DIR, "readOnly": True})
        volumes.append(
            {
                "name": "temporal-tls",
                "secret": {
                    "secretName": "forge-temporal-tls",
                    "defaultMode": 0o440,
                    "items": [
                        {"key": f, "path": f} for f in ("ca.pem", "orchestrator.pem", "orchestrator.key")
                    ],
                },
            }
        )
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": host(spec), "namespace": NAMESPACE, "labels": _labels(spec)},
        "spec": {
            "replicas": SCALED_SERVICES[spec.name][0] if spec.name in SCALED_SERVICES else 1,
            "selector": {"matchLabels": {"app.kubernetes.io/name": host(spec)}},
            "template": {
                "metadata": {
                    "labels": _labels(spec),
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(spec.http_port),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": {
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": UID,
                        "runAsGroup": UID,
                        "fsGroup": UID,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        },
    }


def _service(spec: ServiceSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": host(spec), "namespace": NAMESPACE, "labels": _labels(spec)},
        "spec": {
            "selector": {"app.kubernetes.io/name": host(spec)},
            "ports": [
                {"name": "grpc", "port": spec.grpc_port, "targetPort": "grpc", "appProtocol": "grpc"},
                {"name": "http", "port": spec.http_port, "targetPort": "http"},
            ],
        },
    }
