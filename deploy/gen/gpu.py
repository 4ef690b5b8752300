"""GPU deployment: the Compose GPU profile (``docker-compose.gpu.yml``) and the Kubernetes GPU
overlay (``deploy/k8s-gpu/``).

- The trainer agent runs the CUDA build of its image on every GPU node, given all the node's GPUs
  (Compose: a device reservation; Kubernetes: a DaemonSet requesting ``nvidia.com/gpu``), and finds
  them itself through NVML. Its image carries vLLM's CUDA build (``/opt/vllm``).
- Serving is deployments: every promotion (``PROMOTE_DEPLOY``) starts the version's vLLM replicas
  as inference jobs the scheduler places on those GPUs, the gateway routes to them once they are
  ready, and the version that lost is drained. A promoted version runs
  :data:`SERVING_MIN_REPLICAS` replicas and scales up to :data:`SERVING_MAX_REPLICAS` on the
  gateway's ``vllm:num_requests_waiting`` signal (the deployment workflow, not a
  HorizontalPodAutoscaler: replicas are scheduler jobs, not pods of their own). The CPU model
  server of the base files stays the gateway's pool for models no deployment serves.
"""

from __future__ import annotations

import json
from typing import Any

from forge_cli.platform import ServiceSpec

from .common import IMAGE_TAG, NAMESPACE, by_name, host

#: The CUDA build of PyTorch the GPU images install (a ``TORCH_VARIANT`` build argument: any
#: variant PyTorch publishes for the pinned torch release, e.g. ``cu126``, ``cu128``, ``cu130``).
CUDA_VARIANT = "cu128"
#: GPUs a trainer agent pod asks for: all of a node's (the agent hands them out to jobs itself).
GPUS_PER_NODE = 8
#: The GPU type serving replicas ask the scheduler for (as the agents register it: ``NVIDIA H100
#: 80GB HBM3`` is ``H100``); in Compose, ``FORGE_SERVING_GPU_TYPE`` overrides it.
SERVING_GPU_TYPE = "H100"
#: Replicas of a promoted version: at least, and at most as the gateway's queue signal asks.
SERVING_MIN_REPLICAS = 1
SERVING_MAX_REPLICAS = 8
#: The team whose inference pool serving replicas are placed in.
SERVING_TEAM = "serving"
_NVIDIA_GPUS = {"devices": [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]}


def serving_settings(gpu_type: str) -> dict[str, str]:
    """The orchestrator's settings (without its prefix) that make promotions roll vLLM replicas."""
    return {
        "PROMOTE_DEPLOY": "true",
        "PROMOTE_DEPLOY_ENGINE": "vllm",
        "PROMOTE_DEPLOY_TEAM": SERVING_TEAM,
        "PROMOTE_DEPLOY_GPU_TYPE": gpu_type,
        "PROMOTE_DEPLOY_REPLICAS": str(SERVING_MIN_REPLICAS),
        "PROMOTE_DEPLOY_MAX_REPLICAS": str(SERVING_MAX_REPLICAS),
        "PROMOTE_DEPLOY_ENGINE_ARGS": json.dumps([]),
    }


def _orchestrator() -> ServiceSpec:
    return by_name()["orchestrator"]


def compose_gpu() -> dict[str, Any]:
    """The override file the GPU profile adds to ``docker-compose.yml``."""
    orch = _orchestrator()
    gpu_type = "${FORGE_SERVING_GPU_TYPE:-" + SERVING_GPU_TYPE + "}"
    return {
        "name": "forge",
        "services": {
            "trainer-agent": {
                "build": {
                    "args": {"TORCH_VARIANT": CUDA_VARIANT, "VLLM_REQUIREMENTS": "requirements-vllm-cuda.txt"}
                },
                "image": f"forge/trainer-agent:{IMAGE_TAG}-cuda",
                # PyTorch's shared memory between a replica's tensor-parallel workers (and NCCL's).
                "ipc": "host",
                "deploy": {"resources": {"reservations": _NVIDIA_GPUS}},
            },
            host(orch): {
                "environment": {f"{orch.prefix}{k}": v for k, v in serving_settings(gpu_type).items()},
            },
        },
    }


def _labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": name, "app.kubernetes.io/part-of": "forge"}


def overlay() -> dict[str, list[dict[str, Any]]]:
    """``deploy/k8s-gpu/``: the base with promotions rolling vLLM replicas on the GPU nodes."""
    orch = _orchestrator()
    patch = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"forge-{host(orch)}-config", "namespace": NAMESPACE},
        "data": {f"{orch.prefix}{k}": v for k, v in serving_settings(SERVING_GPU_TYPE).items()},
    }
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "metadata": {"name": "forge-gpu"},
        "namespace": NAMESPACE,
        "resources": ["../k8s"],
        "patches": [{"path": "orchestrator-serving.yaml"}],
    }
    return {"orchestrator-serving.yaml": [patch], "kustomization.yaml": [kustomization]}


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
    # Shared memory for a replica's tensor-parallel workers and NCCL (the runtime's 64 MiB is too little).
    container.setdefault("volumeMounts", []).append({"name": "shm", "mountPath": "/dev/shm"})
    pod.setdefault("volumes", []).append(
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}
    )
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
