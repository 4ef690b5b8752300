"""The Compose file: the infrastructure containers, MLflow, and one container per service."""

from __future__ import annotations

import json
from typing import Any

from forge_cli import secretsfile
from forge_cli.platform import SERVICES, Backing
from forge_cli.secretsfile import required

from . import monitoring, qdrant
from .common import (
    BIND,
    DATA_ROOT,
    IMAGE_TAG,
    KAFKA_ADMIN_LISTENER,
    MLFLOW_COMPOSE_URL,
    MLFLOW_HEALTHCHECK,
    MLFLOW_LOCAL_PORT,
    MLFLOW_PORT,
    PRIVATE_BIND,
    QDRANT_COMPOSE_URL,
    TLS_DIR,
    UID,
    by_name,
    healthcheck_command,
    host,
    http_url,
    mlflow_command,
    secret_env,
    service_settings,
    temporal_tls_settings,
    tls_mounts,
)


def compose() -> dict[str, Any]:
    healthy = {"condition": "service_healthy"}
    services: dict[str, Any] = {
        "postgres": {
            "image": "postgres:16",
            "environment": {
                "POSTGRES_USER": "forge",
                "POSTGRES_PASSWORD": required(secretsfile.POSTGRES_PASSWORD),
            },
            "volumes": [
                "postgres-data:/var/lib/postgresql/data",
                "./deploy/postgres/init.sql:/docker-entrypoint-initdb.d/init.sql:ro",
            ],
            "healthcheck": {
                "test": ["CMD-SHELL", "pg_isready -U forge -d postgres"],
                "interval": "5s",
                "timeout": "3s",
                "retries": 20,
            },
        },
        "redis": {
            "image": "redis:7-alpine",
            "healthcheck": {
                "test": ["CMD", "redis-cli", "ping"],
                "interval": "5s",
                "timeout": "3s",
                "retries": 20,
            },
        },
        "kafka": {
            "image": "apache/kafka:3.9.1",
            "environment": {
                "KAFKA_NODE_ID": "1",
                "KAFKA_PROCESS_ROLES": "broker,controller",
                # Services reach the broker on 9092 with SASL/SCRAM, each as its own user with its
                # own ACLs (deploy/kafka/setup.sh). The controller and the admin listener are
                # PLAINTEXT on the container's loopback only: nothing else can reach them.
                "KAFKA_LISTENERS": f"SASL://:9092,LOCAL://{KAFKA_ADMIN_LISTENER},CONTROLLER://127.0.0.1:9093",
                "KAFKA_ADVERTISED_LISTENERS": f"SASL://kafka:9092,LOCAL://{KAFKA_ADMIN_LISTENER}",
                "KAFKA_CONTROLLER_LISTENER_NAMES": "CONTROLLER",
                "KAFKA_INTER_BROKER_LISTENER_NAME": "LOCAL",
                "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP": "CONTROLLER:PLAINTEXT,SASL:SASL_PLAINTEXT,LOCAL:PLAINTEXT",
                "KAFKA_CONTROLLER_QUORUM_VOTERS": "1@127.0.0.1:9093",
                "KAFKA_SASL_ENABLED_MECHANISMS": "SCRAM-SHA-512",
                "KAFKA_LISTENER_NAME_SASL_SCRAM___SHA___512_SASL_JAAS_CONFIG": (
                    "org.apache.kafka.common.security.scram.ScramLoginModule required;"
                ),
                "KAFKA_AUTHORIZER_CLASS_NAME": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
                "KAFKA_ALLOW_EVERYONE_IF_NO_ACL_FOUND": "false",
                # Only the loopback listeners are unauthenticated (ANONYMOUS): the broker itself
                # and the setup script inside the container.
                "KAFKA_SUPER_USERS": "User:ANONYMOUS",
                "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR": "1",
                "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR": "1",
                "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR": "1",
                "KAFKA_NUM_PARTITIONS": "3",
                # deploy/kafka/setup.sh creates every topic before any service starts.
                "KAFKA_AUTO_CREATE_TOPICS_ENABLE": "false",
                **{
                    secretsfile.kafka_password_var(s): required(secretsfile.kafka_password_var(s))
                    for s in sorted({spec.service for spec in SERVICES})
                },
            },
            "command": ["bash", "/opt/forge/kafka-start.sh"],
            "volumes": [
                "kafka-data:/var/lib/kafka/data",
                "./deploy/kafka/start.sh:/opt/forge/kafka-start.sh:ro",
                "./deploy/kafka/setup.sh:/opt/forge/kafka-setup.sh:ro",
            ],
            "healthcheck": {
                "test": [
                    "CMD-SHELL",
                    "test -f /tmp/forge-kafka-ready && /opt/kafka/bin/kafka-broker-api-versions.sh "
                    f"--bootstrap-server {KAFKA_ADMIN_LISTENER} >/dev/null",
                ],
                "interval": "10s",
                "timeout": "10s",
                "retries": 12,
                "start_period": "20s",
            },
        },
        "temporal": {
            "image": "temporalio/auto-setup:1.27.2",
            "environment": {
                "DB": "postgres12",
                "DB_PORT": "5432",
                "POSTGRES_USER": "forge",
                "POSTGRES_PWD": required(secretsfile.POSTGRES_PASSWORD),
                "POSTGRES_SEEDS": "postgres",
                "BIND_ON_IP": "0.0.0.0",
                "TEMPORAL_BROADCAST_ADDRESS": "127.0.0.1",
                # Mutual TLS on the frontend and between nodes: only holders of a certificate of
                # the CA `make secrets` created get in (var/secrets/temporal-tls).
                "TEMPORAL_TLS_REQUIRE_CLIENT_AUTH": "true",
                "TEMPORAL_TLS_SERVER_CA_CERT": f"{TLS_DIR}/ca.pem",
                "TEMPORAL_TLS_SERVER_CERT": f"{TLS_DIR}/server.pem",
                "TEMPORAL_TLS_SERVER_KEY": f"{TLS_DIR}/server.key",
                "TEMPORAL_TLS_FRONTEND_CERT": f"{TLS_DIR}/server.pem",
                "TEMPORAL_TLS_FRONTEND_KEY": f"{TLS_DIR}/server.key",
                "TEMPORAL_TLS_CLIENT1_CA_CERT": f"{TLS_DIR}/ca.pem",
                "TEMPORAL_TLS_INTERNODE_SERVER_NAME": "temporal",
                "TEMPORAL_TLS_FRONTEND_SERVER_NAME": "temporal",
                # The image's own setup (temporal CLI; its current and older variable names) and
                # health check (tctl) connect as "admin".
                "TEMPORAL_TLS": "true",
                "TEMPORAL_TLS_CLIENT_CERT_PATH": f"{TLS_DIR}/admin.pem",
                "TEMPORAL_TLS_CLIENT_KEY_PATH": f"{TLS_DIR}/admin.key",
                "TEMPORAL_TLS_SERVER_CA_CERT_PATH": f"{TLS_DIR}/ca.pem",
                "TEMPORAL_TLS_CA": f"{TLS_DIR}/ca.pem",
                "TEMPORAL_TLS_CERT": f"{TLS_DIR}/admin.pem",
                "TEMPORAL_TLS_KEY": f"{TLS_DIR}/admin.key",
                "TEMPORAL_TLS_SERVER_NAME": "temporal",
                "TEMPORAL_CLI_TLS_CA": f"{TLS_DIR}/ca.pem",
                "TEMPORAL_CLI_TLS_CERT": f"{TLS_DIR}/admin.pem",
                "TEMPORAL_CLI_TLS_KEY": f"{TLS_DIR}/admin.key",
                "TEMPORAL_CLI_TLS_SERVER_NAME": "temporal",
            },
            "volumes": tls_mounts("ca.pem", "server.pem", "server.key", "admin.pem", "admin.key"),
            "depends_on": {"postgres": healthy},
            "ports": [f"{BIND}:7233:7233"],
            "healthcheck": {
                "test": ["CMD-SHELL", "tctl --address 127.0.0.1:7233 cluster health | grep -q SERVING"],
                "interval": "10s",
                "timeout": "5s",
                "retries": 30,
                "start_period": "30s",
            },
        },
        "temporal-ui": {
            "image": "temporalio/ui:2.34.0",
            "environment": {
                "TEMPORAL_ADDRESS": "temporal:7233",
                "TEMPORAL_UI_PORT": "8080",
                "TEMPORAL_TLS_CA": f"{TLS_DIR}/ca.pem",
                "TEMPORAL_TLS_CERT": f"{TLS_DIR}/ui.pem",
                "TEMPORAL_TLS_KEY": f"{TLS_DIR}/ui.key",
                "TEMPORAL_TLS_SERVER_NAME": "temporal",
                "TEMPORAL_TLS_ENABLE_HOST_VERIFICATION": "true",
            },
            "volumes": tls_mounts("ca.pem", "ui.pem", "ui.key"),
            "depends_on": {"temporal": healthy},
            "ports": [f"{PRIVATE_BIND}:8233:8080"],
            "healthcheck": {
                "test": ["CMD-SHELL", "wget -q -O /dev/null http://127.0.0.1:8080/ || exit 1"],
                "interval": "10s",
                "timeout": "3s",
                "retries": 10,
            },
        },
        "mlflow": {
            "build": {"context": ".", "dockerfile": "deploy/mlflow/Dockerfile"},
            "image": f"forge/mlflow:{IMAGE_TAG}",
            "user": f"{UID}:{UID}",
            "command": mlflow_command(
                f"postgresql://forge:{required(secretsfile.POSTGRES_PASSWORD)}@postgres:5432/forge_mlflow",
                ("mlflow", f"mlflow:{MLFLOW_PORT}", "localhost", f"localhost:{MLFLOW_LOCAL_PORT}"),
            ),
            "depends_on": {"postgres": healthy},
            # The UI has no login of its own: like every port, published on loopback by default.
            "ports": [f"{PRIVATE_BIND}:{MLFLOW_LOCAL_PORT}:{MLFLOW_PORT}"],
            "volumes": [f"objects:{DATA_ROOT}/objects"],
            "healthcheck": {
                "test": MLFLOW_HEALTHCHECK,
                "interval": "10s",
                "timeout": "5s",
                "retries": 12,
                "start_period": "30s",
            },
            "restart": "unless-stopped",
        },
        "qdrant": qdrant.compose_service(),
    }
    for spec in SERVICES:
        env = service_settings(
            spec,
            kafka="kafka:9092",
            temporal="temporal:7233",
            mlflow=MLFLOW_COMPOSE_URL,
            backing=Backing(
                database_url=f"postgresql+asyncpg://forge:{required(secretsfile.POSTGRES_PASSWORD)}@postgres:5432/{{database}}",
                redis_url="redis://redis:6379/0",
                qdrant_url=QDRANT_COMPOSE_URL,
            ),
        )
        for key, variable in secret_env(spec).items():
            # No secret has a default: `make secrets` writes them all into .env (mode 0600).
            env[key] = required(variable)
        if spec.name == "trainer_agent":
            # The replicas it starts are reached at this container's name (the gateway routes to
            # them, the orchestrator checks their health).
            env[f"{spec.prefix}ADVERTISE_ADDRESS"] = host(spec)
        if spec.name == "orchestrator":
            # The guarded canary reads the traffic of each arm from the gateway's counters: Compose
            # runs one gateway, so its /metrics is all of it (Kubernetes' replicas are not one URL).
            gateway = http_url(by_name()["inference_gateway"])
            env[f"{spec.prefix}GATEWAY_METRICS_URLS"] = json.dumps([f"{gateway}/metrics"])
        volumes = [f"{host(spec)}-data:{DATA_ROOT}/data", f"objects:{DATA_ROOT}/objects"]
        if spec.temporal:
            env.update(temporal_tls_settings(spec, "orchestrator"))
            volumes += tls_mounts("ca.pem", "orchestrator.pem", "orchestrator.key")
        depends = {name: healthy for name in ("postgres", "redis", "kafka")}
        if spec.temporal:
            depends["temporal"] = healthy
        if spec.tracking:
            depends["mlflow"] = healthy
        if spec.name == "retriever":
            depends["qdrant"] = healthy
        depends.update({host(c.target): healthy for c in spec.calls})
        services[host(spec)] = {
            "build": {"context": ".", "dockerfile": f"services/{spec.name}/Dockerfile"},
            "image": f"forge/{host(spec)}:{IMAGE_TAG}",
            "user": f"{UID}:{UID}",
            "environment": env,
            "ports": [
                f"{BIND}:{spec.grpc_port}:{spec.grpc_port}",
                f"{BIND}:{spec.http_port}:{spec.http_port}",
            ],
            "volumes": volumes,
            "depends_on": depends,
            "healthcheck": {
                "test": healthcheck_command(spec.http_port),
                "interval": "10s",
                "timeout": "5s",
                "retries": 10,
                "start_period": "30s",
            },
            "restart": "unless-stopped",
        }
    services.update(monitoring.compose_services())
    volumes = [
        "prometheus-data",
        "grafana-data",
        "postgres-data",
        "kafka-data",
        "qdrant-data",
        "objects",
        *(f"{host(s)}-data" for s in SERVICES),
    ]
    return {"name": "forge", "services": services, "volumes": {v: {} for v in volumes}}
