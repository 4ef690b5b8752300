"""GPU deployment: the Compose GPU profile (``docker-compose.gpu.yml``) and the Kubernetes GPU
overlay (``deploy/k8s-gpu/``).

- vLLM's official OpenAI server (``vllm/vllm-openai``) serves a registered checkpoint's Hugging Face
  export from the object store; the gateway's model-server URL points at it, exactly as at the CPU
  model server (same ``/v1`` API, same bearer token, the same ``vllm:*`` metric names), so
  admission, routing and dashboards do not change.
- The trainer agent runs the CUDA build of its image on every GPU node, given all the node's GPUs
  (Compose: a device reservation; Kubernetes: a DaemonSet requesting ``nvidia.com/gpu``), and finds
  them itself through NVML.
- vLLM scales on ``vllm:num_requests_waiting`` (Prometheus Adapter exposes it as the pods metric
  ``vllm_num_requests_waiting``: ``deploy/prometheus/adapter-rules.yaml``).
"""

from __future__ import annotations

from typing import Any

from forge_cli import secretsfile
from forge_cli.platform import ServiceSpec
from forge_cli.secretsfile import required

from .common import DATA_ROOT, IMAGE_TAG, NAMESPACE, by_name, host

#: vLLM's release on PyPI at the time of writing, and its official server image of the same tag.
VLLM_VERSION = "0.33.0"
VLLM_IMAGE = f"vllm/vllm-openai:v{VLLM_VERSION}"
VLLM_PORT = 8000
#: The CUDA build of PyTorch the GPU images install (a ``TORCH_VARIANT`` build argument: any
#: variant PyTorch publishes for the pinned torch release, e.g. ``cu126``, ``cu128``, ``cu130``).
CUDA_VARIANT = "cu128"
#: GPUs a trainer agent pod asks for: all of a node's (the agent hands them out to jobs itself).
GPUS_PER_NODE = 8
#: Where the served checkpoint's Hugging Face export is, in the object store (docs/DEPLOY.md).
SERVED_MODEL_PATH = f"{DATA_ROOT}/objects/serving/current/hf"
SERVED_MODEL_NAME = "forge-serving"
VLLM_ARGS = [
    "--served-model-name",
    "$(SERVED_MODEL_NAME)",
    "--port",
    str(VLLM_PORT),
    # The gateway sends a request's priority; vLLM schedules by it (lower first), as the CPU server does.
    "--scheduling-policy",
    "priority",
    "--enable-prefix-caching",
]
GPU_WORKLOADS = ("vllm", "trainer-agent")
_NVIDIA_GPUS = {"devices": [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]}
_HEALTH = [
    "CMD",
    "python3",
    "-c",
    "import sys, urllib.request; "
    f"sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:{VLLM_PORT}/health', timeout=3).status == 200 else 1)",
]


def gateway() -> ServiceSpec:
    return by_name()["inference_gateway"]


def compose_gpu() -> dict[str, Any]:
    """The override file the GPU profile adds to ``docker-compose.yml``."""
    gw = gateway()
    model = "${FORGE_VLLM_MODEL:-" + SERVED_MODEL_PATH + "}"
    name = "${FORGE_VLLM_MODEL_NAME:-" + SERVED_MODEL_NAME + "}"
    return {
        "name": "forge",
        "services": {
            "vllm": {
                "image": VLLM_IMAGE,
                "entrypoint": ["vllm", "serve"],
                "command": [model, *(name if a == "$(SERVED_MODEL_NAME)" else a for a in VLLM_ARGS)],
                "environment": {
                    # The gateway presents the model server's token; vLLM checks it as its API key.
                    "VLLM_API_KEY": required(secretsfile.token_var("model_server")),
                    "HF_HUB_OFFLINE": "1",
                },
                "volumes": [f"objects:{DATA_ROOT}/objects:ro"],
                "ipc": "host",  # PyTorch's shared memory between tensor-parallel workers
                "deploy": {"resources": {"reservations": _NVIDIA_GPUS}},
                "healthcheck": {
                    "test": _HEALTH,
                    "interval": "10s",
                    "timeout": "5s",
                    "retries": 60,
                    "start_period": "120s",
                },
                "restart": "unless-stopped",
            },
            "trainer-agent": {
                "build": {
                    "args": {"TORCH_VARIANT": CUDA_VARIANT, "VLLM_REQUIREMENTS": "requirements-vllm-cuda.txt"}
                },
                "image": f"forge/trainer-agent:{IMAGE_TAG}-cuda",
                "deploy": {"resources": {"reservations": _NVIDIA_GPUS}},
            },
            host(gw): {
                "environment": {f"{gw.prefix}MODEL_SERVER_URL": f"http://vllm:{VLLM_PORT}"},
                "depends_on": {"vllm": {"condition": "service_healthy"}},
            },
        },
    }


def _labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": name, "app.kubernetes.io/part-of": "forge"}


def vllm_manifests() -> list[dict[str, Any]]:
    """vLLM's Deployment, Service, autoscaler, budget, network policy and settings."""
    meta = {"namespace": NAMESPACE, "labels": _labels("vllm")}
    gw = gateway()
    probe = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10, "timeoutSeconds": 5}
    config = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "forge-vllm-config", **meta},
        "data": {
            "MODEL_PATH": SERVED_MODEL_PATH,
            "SERVED_MODEL_NAME": SERVED_MODEL_NAME,
            "HF_HUB_OFFLINE": "1",
        },
    }
    container = {
        "name": "vllm",
        "image": VLLM_IMAGE,
        "command": ["vllm", "serve"],
        "args": ["$(MODEL_PATH)", *VLLM_ARGS],
        "ports": [{"name": "http", "containerPort": VLLM_PORT}],
        "envFrom": [{"configMapRef": {"name": "forge-vllm-config"}}],
        "env": [
            {
                "name": "VLLM_API_KEY",
                "valueFrom": {"secretKeyRef": {"name": "forge-tokens", "key": "model_server"}},
            }
        ],
        # Loading weights and compiling CUDA graphs takes minutes: the start-up probe waits.
        "startupProbe": {**probe, "failureThreshold": 90},
        "readinessProbe": probe,
        "livenessProbe": {**probe, "failureThreshold": 3},
        "resources": {
            "requests": {"cpu": "4", "memory": "32Gi", "nvidia.com/gpu": "1"},
            "limits": {"cpu": "16", "memory": "64Gi", "nvidia.com/gpu": "1"},
        },
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [
            {"name": "objects", "mountPath": f"{DATA_ROOT}/objects", "readOnly": True},
            {"name": "shm", "mountPath": "/dev/shm"},
        ],
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "vllm", **meta},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app.kubernetes.io/name": "vllm"}},
            "template": {
                "metadata": {
                    "labels": _labels("vllm"),
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(VLLM_PORT),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": {
                    "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "containers": [container],
                    "volumes": [
                        {
                            "name": "objects",
                            "persistentVolumeClaim": {"claimName": "forge-objects", "readOnly": True},
                        },
                        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}},
                    ],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "vllm", **meta},
        "spec": {
            "selector": {"app.kubernetes.io/name": "vllm"},
            "ports": [{"name": "http", "port": VLLM_PORT, "targetPort": "http"}],
        },
    }
    autoscaler = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "vllm", **meta},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "vllm"},
            "minReplicas": 1,
            "maxReplicas": 8,
            # vllm:num_requests_waiting through Prometheus Adapter (deploy/prometheus/adapter-rules.yaml).
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": "vllm_num_requests_waiting"},
                        "target": {"type": "AverageValue", "averageValue": "4"},
                    },
                }
            ],
            # A new replica needs minutes to load: scale up at once, down slowly.
            "behavior": {
                "scaleUp": {"stabilizationWindowSeconds": 0},
                "scaleDown": {"stabilizationWindowSeconds": 600},
            },
        },
    }
    budget = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "vllm", **meta},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app.kubernetes.io/name": "vllm"}}},
    }
    policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "vllm-ingress", **meta},
        "spec": {
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "vllm"}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [
                        {"podSelector": {"matchLabels": {"app.kubernetes.io/name": host(gw)}}},
                        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
                    ],
                    "ports": [{"port": VLLM_PORT, "protocol": "TCP"}],
                }
            ],
        },
    }
    return [config, deployment, service, autoscaler, budget, policy]


def overlay() -> dict[str, list[dict[str, Any]]]:
    """``deploy/k8s-gpu/``: the base plus vLLM, with the gateway pointed at vLLM."""
    gw = gateway()
    patch = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"forge-{host(gw)}-config", "namespace": NAMESPACE},
        "data": {f"{gw.prefix}MODEL_SERVER_URL": f"http://vllm.{NAMESPACE}.svc:{VLLM_PORT}"},
    }
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "metadata": {"name": "forge-gpu"},
        "namespace": NAMESPACE,
        "resources": ["../k8s", "vllm.yaml"],
        "patches": [{"path": "gateway-to-vllm.yaml"}],
    }
    return {
        "vllm.yaml": vllm_manifests(),
        "gateway-to-vllm.yaml": [patch],
        "kustomization.yaml": [kustomization],
    }


def agent_daemonset(deployment: dict[str, Any], spec: ServiceSpec) -> dict[str, Any]:
    """The trainer agent's Deployment turned into a DaemonSet on GPU nodes: the CUDA image, all of
    the node's GPUs, the node's name and the pod's address for multi-node rendezvous."""
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    container["image"] = f"forge/{host(spec)}:{IMAGE_TAG}-cuda"
    for kind in ("requests", "limits"):
        container["resources"][kind]["nvidia.com/gpu"] = str(GPUS_PER_NODE)
    container["env"] += [
        {"name": f"{spec.prefix}NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": f"{spec.prefix}ADVERTISE_ADDRESS", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    # The NVIDIA device plugin (GPU Operator) labels GPU nodes and taints them for GPU work only.
    pod["nodeSelector"] = {"nvidia.com/gpu.present": "true"}
    pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": deployment["metadata"],
        "spec": {
            "selector": deployment["spec"]["selector"],
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "template": deployment["spec"]["template"],
        },
    }


def agent_peer_policy(spec: ServiceSpec) -> dict[str, Any]:
    """Multi-node jobs' traffic between trainer agent pods: torchrun's c10d rendezvous on the
    scheduler-chosen port, NCCL's bootstrap and data sockets on ephemeral ports."""
    agents = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": host(spec)}}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": f"{host(spec)}-peers", "namespace": NAMESPACE, "labels": _labels(host(spec))},
        "spec": {
            "podSelector": agents["podSelector"],
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [agents]}],
        },
    }


#: Prometheus Adapter's rule exposing vLLM's queue as the pods metric the autoscaler reads.
ADAPTER_RULES = {
    "rules": {
        "custom": [
            {
                "seriesQuery": 'vllm:num_requests_waiting{namespace!="",pod!=""}',
                "resources": {
                    "overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
                },
                "name": {"matches": "^vllm:num_requests_waiting$", "as": "vllm_num_requests_waiting"},
                "metricsQuery": "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)",
            }
        ]
    }
}
