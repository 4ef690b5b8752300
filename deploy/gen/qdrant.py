"""The Qdrant server the retriever indexes into in production: a Compose container, and in
Kubernetes a StatefulSet running Qdrant's distributed mode (shards replicated across pods).

Sizing (docs/DEPLOY.md, "Qdrant for 100M documents"): the collection layout the retriever creates
comes from its ``QDRANT_*`` settings (:data:`K8S_LAYOUT` in Kubernetes, one node's in Compose).
"""

from __future__ import annotations

from typing import Any

from .common import (
    NAMESPACE,
    QDRANT_GRPC_PORT,
    QDRANT_HTTP_PORT,
    QDRANT_IMAGE,
)

QDRANT_P2P_PORT = 6335
#: Qdrant pods in Kubernetes: with replication factor 2 a collection survives losing one.
K8S_NODES = 3
#: The collection layout the retriever asks the Kubernetes Qdrant cluster for (docs/DEPLOY.md):
#: 12 shards (several per node, so adding nodes rebalances without resharding), 2 replicas each.
K8S_LAYOUT = {"shards": 12, "replication_factor": 2}
#: What every production deployment's collections keep where (platform.production_env fills
#: the shard and replica counts per deployment).
LABELS = {"app.kubernetes.io/name": "qdrant", "app.kubernetes.io/part-of": "forge"}
API_KEY_SECRET = ("forge-qdrant", "api-key")


def compose_service() -> dict[str, Any]:
    return {
        "image": QDRANT_IMAGE,
        "volumes": ["qdrant-data:/qdrant/storage"],
        # Reachable on the Compose network only (no published port): the retriever is its client.
        # The image has bash but neither curl nor wget.
        "healthcheck": {
            "test": ["CMD-SHELL", f"bash -c ':> /dev/tcp/127.0.0.1/{QDRANT_HTTP_PORT}' || exit 1"],
            "interval": "5s",
            "timeout": "3s",
            "retries": 20,
        },
    }


def k8s_manifests() -> list[dict[str, Any]]:
    """Headless Service (peer discovery), client Service, StatefulSet, budget, network policy."""
    meta = {"namespace": NAMESPACE, "labels": LABELS}
    ports = [
        {"name": "http", "port": QDRANT_HTTP_PORT, "targetPort": "http"},
        {"name": "grpc", "port": QDRANT_GRPC_PORT, "targetPort": "grpc", "appProtocol": "grpc"},
    ]
    headless = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "qdrant-headless", **meta},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {"app.kubernetes.io/name": "qdrant"},
            "ports": [*ports, {"name": "p2p", "port": QDRANT_P2P_PORT, "targetPort": "p2p"}],
        },
    }
    client = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "qdrant", **meta},
        "spec": {"selector": {"app.kubernetes.io/name": "qdrant"}, "ports": ports},
    }
    peer = f"qdrant-headless.{NAMESPACE}.svc.cluster.local:{QDRANT_P2P_PORT}"
    # Pod 0 starts the cluster; every other pod joins it through pod 0 (Qdrant's --bootstrap).
    start = (
        f'if [ "${{HOSTNAME##*-}}" = 0 ]; then exec ./entrypoint.sh --uri "http://$HOSTNAME.{peer}"; '
        f'else exec ./entrypoint.sh --uri "http://$HOSTNAME.{peer}" --bootstrap "http://qdrant-0.{peer}"; fi'
    )
    probe = {"periodSeconds": 10, "timeoutSeconds": 3}
    container = {
        "name": "qdrant",
        # The unprivileged variant of the same release runs as uid 1000.
        "image": f"{QDRANT_IMAGE}-unprivileged",
        "command": ["/bin/bash", "-c", start],
        "ports": [
            {"name": "http", "containerPort": QDRANT_HTTP_PORT},
            {"name": "grpc", "containerPort": QDRANT_GRPC_PORT},
            {"name": "p2p", "containerPort": QDRANT_P2P_PORT},
        ],
        "env": [
            {"name": "QDRANT__CLUSTER__ENABLED", "value": "true"},
            {"name": "QDRANT__CLUSTER__P2P__PORT", "value": str(QDRANT_P2P_PORT)},
            {"name": "QDRANT__TELEMETRY_DISABLED", "value": "true"},
            {
                "name": "QDRANT__SERVICE__API_KEY",
                "valueFrom": {"secretKeyRef": {"name": API_KEY_SECRET[0], "key": API_KEY_SECRET[1]}},
            },
        ],
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "http"}, "initialDelaySeconds": 5, **probe},
        "livenessProbe": {"httpGet": {"path": "/livez", "port": "http"}, "initialDelaySeconds": 20, **probe},
        # docs/DEPLOY.md: 100M documents on 3 nodes x 2 replicas needs ~64 GiB of RAM per node with
        # int8 quantization in RAM and the originals, payloads and the sparse index on disk.
        "resources": {
            "requests": {"cpu": "4", "memory": "64Gi"},
            "limits": {"cpu": "16", "memory": "96Gi"},
        },
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "runAsGroup": 1000,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [{"name": "storage", "mountPath": "/qdrant/storage"}],
    }
    statefulset = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": "qdrant", **meta},
        "spec": {
            "serviceName": "qdrant-headless",
            "replicas": K8S_NODES,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": {"app.kubernetes.io/name": "qdrant"}},
            "template": {
                "metadata": {
                    "labels": LABELS,
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(QDRANT_HTTP_PORT),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": {
                    "securityContext": {"fsGroup": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
                    # One Qdrant pod per Kubernetes node: two replicas of a shard never share a node.
                    "affinity": {
                        "podAntiAffinity": {
                            "requiredDuringSchedulingIgnoredDuringExecution": [
                                {
                                    "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "qdrant"}},
                                    "topologyKey": "kubernetes.io/hostname",
                                }
                            ]
                        }
                    },
                    "containers": [container],
                },
            },
            "volumeClaimTemplates": [
                {
                    "metadata": {"name": "storage"},
                    "spec": {
                        "accessModes": ["ReadWriteOnce"],
                        # Originals, payloads, sparse index and WAL of ~200M points' replicas per node.
                        "resources": {"requests": {"storage": "500Gi"}},
                    },
                }
            ],
        },
    }
    budget = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "qdrant", **meta},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app.kubernetes.io/name": "qdrant"}}},
    }
    return [headless, client, statefulset, budget]


def network_policy(monitoring: dict[str, Any]) -> dict[str, Any]:
    """The retriever on the API ports, the other Qdrant pods on every port, monitoring on HTTP."""
    retriever = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "retriever"}}}
    peers = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "qdrant"}}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "qdrant-ingress", "namespace": NAMESPACE, "labels": LABELS},
        "spec": {
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "qdrant"}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [retriever, peers],
                    "ports": [
                        {"port": QDRANT_HTTP_PORT, "protocol": "TCP"},
                        {"port": QDRANT_GRPC_PORT, "protocol": "TCP"},
                    ],
                },
                {"from": [peers], "ports": [{"port": QDRANT_P2P_PORT, "protocol": "TCP"}]},
                {"from": [monitoring], "ports": [{"port": QDRANT_HTTP_PORT, "protocol": "TCP"}]},
            ],
        },
    }
