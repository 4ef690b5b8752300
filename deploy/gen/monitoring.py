"""Monitoring: the Prometheus scrape configuration, the SLO alerting rules and the Grafana dashboard."""

from __future__ import annotations

from typing import Any

from forge_cli import secretsfile
from forge_cli.platform import SERVICES
from forge_cli.secretsfile import required

from .common import BIND, PRIVATE_BIND, host

PROMETHEUS_IMAGE = "prom/prometheus:v3.5.0"
GRAFANA_IMAGE = "grafana/grafana:12.1.1"
PROMETHEUS_PORT = 9090
GRAFANA_PORT = 3000


def prometheus() -> dict[str, Any]:
    return {
        "global": {"scrape_interval": "15s", "evaluation_interval": "15s"},
        "rule_files": ["alerts.yml"],
        "scrape_configs": [
            *(
                {
                    "job_name": f"forge-{host(spec)}",
                    "metrics_path": "/metrics",
                    # Compose host names; in Kubernetes the same names resolve inside the forge namespace.
                    "static_configs": [
                        {"targets": [f"{host(spec)}:{spec.http_port}"], "labels": {"service": spec.name}}
                    ],
                }
                for spec in SERVICES
            ),
            # The GPU profile's vLLM server (absent without it) and the retriever's Qdrant server.
            {
                "job_name": "vllm",
                "static_configs": [{"targets": ["vllm:8000"], "labels": {"service": "vllm"}}],
            },
            {
                "job_name": "qdrant",
                "static_configs": [{"targets": ["qdrant:6333"], "labels": {"service": "qdrant"}}],
            },
        ],
    }


def compose_services() -> dict[str, Any]:
    """Prometheus and Grafana in the Compose ``monitoring`` profile, provisioned with the rules,
    the data source and the dashboards of ``deploy/``."""
    return {
        "prometheus": {
            "image": PROMETHEUS_IMAGE,
            "profiles": ["monitoring"],
            "command": [
                "--config.file=/etc/prometheus/prometheus.yml",
                "--storage.tsdb.path=/prometheus",
                "--storage.tsdb.retention.time=15d",
            ],
            "volumes": [
                "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro",
                "./deploy/prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro",
                "prometheus-data:/prometheus",
            ],
            "ports": [f"{PRIVATE_BIND}:{PROMETHEUS_PORT}:{PROMETHEUS_PORT}"],
            "healthcheck": {
                "test": [
                    "CMD",
                    "wget",
                    "-q",
                    "-O",
                    "/dev/null",
                    f"http://127.0.0.1:{PROMETHEUS_PORT}/-/ready",
                ],
                "interval": "10s",
                "timeout": "3s",
                "retries": 10,
            },
            "restart": "unless-stopped",
        },
        "grafana": {
            "image": GRAFANA_IMAGE,
            "profiles": ["monitoring"],
            "environment": {
                "GF_SECURITY_ADMIN_USER": "admin",
                "GF_SECURITY_ADMIN_PASSWORD": required(secretsfile.GRAFANA_ADMIN_PASSWORD),
                "GF_AUTH_ANONYMOUS_ENABLED": "false",
                "GF_USERS_ALLOW_SIGN_UP": "false",
            },
            "volumes": [
                "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro",
                "./deploy/grafana/dashboards:/var/lib/grafana/dashboards:ro",
                "grafana-data:/var/lib/grafana",
            ],
            "depends_on": {"prometheus": {"condition": "service_healthy"}},
            "ports": [f"{BIND}:{GRAFANA_PORT}:{GRAFANA_PORT}"],
            "healthcheck": {
                "test": [
                    "CMD",
                    "wget",
                    "-q",
                    "-O",
                    "/dev/null",
                    f"http://127.0.0.1:{GRAFANA_PORT}/api/health",
                ],
                "interval": "10s",
                "timeout": "3s",
                "retries": 10,
            },
            "restart": "unless-stopped",
        },
    }


#: Grafana's provisioning: the Prometheus data source (uid ``prometheus``, as every panel names
#: it) and the folder of dashboards.
GRAFANA_DATASOURCES = {
    "apiVersion": 1,
    "datasources": [
        {
            "name": "Prometheus",
            "uid": "prometheus",
            "type": "prometheus",
            "access": "proxy",
            "url": f"http://prometheus:{PROMETHEUS_PORT}",
            "isDefault": True,
        }
    ],
}
GRAFANA_DASHBOARD_PROVIDERS = {
    "apiVersion": 1,
    "providers": [
        {
            "name": "forge",
            "folder": "Forge",
            "type": "file",
            "allowUiUpdates": False,
            "options": {"path": "/var/lib/grafana/dashboards"},
        }
    ],
}


#: Alerting rules on the SLOs. Each expression uses metric names the services export today.
ALERT_RULES: list[dict[str, Any]] = [
    {
        "alert": "ForgeInferenceTTFTHigh",
        "expr": "histogram_quantile(0.99, sum by (le, model_name) "
        "(rate(vllm:time_to_first_token_seconds_bucket[5m]))) > 2",
        "for": "10m",
        "labels": {"severity": "page"},
        "annotations": {"summary": "TTFT p99 above 2 s for {{ $labels.model_name }}"},
    },
    {
        "alert": "ForgeInferenceQueueBuilding",
        "expr": "sum by (model_name) (vllm:num_requests_waiting) > 32",
        "for": "5m",
        "labels": {"severity": "ticket"},
        "annotations": {"summary": "{{ $labels.model_name }} has {{ $value }} requests waiting"},
    },
    {
        "alert": "ForgeGrpcErrors",
        "expr": 'sum by (service, method) (rate(forge_grpc_requests_total{code=~"INTERNAL|UNAVAILABLE|DEADLINE_EXCEEDED"}[5m]))'
        " / sum by (service, method) (rate(forge_grpc_requests_total[5m])) > 0.05",
        "for": "10m",
        "labels": {"severity": "page"},
        "annotations": {"summary": "{{ $labels.service }} {{ $labels.method }}: over 5% server errors"},
    },
    {
        "alert": "ForgeOutboxBacklog",
        "expr": "max by (job) (forge_outbox_pending) > 1000",
        "for": "10m",
        "labels": {"severity": "page"},
        "annotations": {
            "summary": "{{ $labels.job }}: events not reaching Kafka (outbox backlog {{ $value }})"
        },
    },
    {
        "alert": "ForgeConsumerDeadLetters",
        "expr": 'sum by (group, topic) (increase(forge_events_consumed_total{outcome="dead_letter"}[15m])) > 0',
        "labels": {"severity": "ticket"},
        "annotations": {"summary": "{{ $labels.group }} dead-lettered events from {{ $labels.topic }}"},
    },
    {
        "alert": "ForgeConsumerLagHigh",
        "expr": "sum by (group, topic) (forge_consumer_lag) > 1000",
        "for": "10m",
        "labels": {"severity": "page"},
        "annotations": {
            "summary": "{{ $labels.group }} is {{ $value }} records behind on {{ $labels.topic }}"
        },
    },
    {
        "alert": "ForgeEvalGateBlocked",
        "expr": 'sum by (suite) (increase(forge_eval_gate_total{decision="blocked"}[1h])) > 0',
        "labels": {"severity": "ticket"},
        "annotations": {
            "summary": "release gate blocked {{ $value }} candidate(s) on suite {{ $labels.suite }} in the last hour"
        },
    },
    {
        "alert": "ForgeSchedulerQueueTimeHigh",
        "expr": "histogram_quantile(0.95, sum by (le, team) "
        "(rate(forge_scheduler_queue_time_seconds_bucket[1h]))) > 4 * 3600",
        "for": "30m",
        "labels": {"severity": "ticket"},
        "annotations": {"summary": "team {{ $labels.team }}: p95 queue time above 4 h"},
    },
    {
        "alert": "ForgeSchedulerCycleSlow",
        "expr": "histogram_quantile(0.99, sum by (le) (rate(forge_scheduler_cycle_seconds_bucket[10m]))) > 0.1",
        "for": "15m",
        "labels": {"severity": "ticket"},
        "annotations": {"summary": "scheduling cycle p99 above 100 ms"},
    },
    {
        "alert": "ForgeGatewayShedding",
        # Every admitted request observes its queue wait once: shed / (shed + admitted).
        "expr": "sum(rate(forge_gateway_shed_total[5m])) / (sum(rate(forge_gateway_shed_total[5m]))"
        " + sum(rate(forge_gateway_queue_wait_seconds_count[5m]))) > 0.01",
        "for": "10m",
        "labels": {"severity": "page"},
        "annotations": {"summary": "the gateway sheds {{ $value | humanizePercentage }} of requests"},
    },
    {
        "alert": "ForgeGatewayQueueWaitHigh",
        "expr": "histogram_quantile(0.99, sum by (le, priority) "
        "(rate(forge_gateway_queue_wait_seconds_bucket[5m]))) > 1",
        "for": "10m",
        "labels": {"severity": "ticket"},
        "annotations": {"summary": "priority {{ $labels.priority }} waits over 1 s (p99) for a replica slot"},
    },
    {
        "alert": "ForgeRagRetrieveSlow",
        "expr": 'histogram_quantile(0.99, sum by (le) (rate(forge_gateway_rag_stage_seconds_bucket{stage="retrieve"}[5m]))) > 0.5',
        "for": "10m",
        "labels": {"severity": "ticket"},
        "annotations": {"summary": "RAG retrieval p99 above 500 ms"},
    },
    {
        "alert": "ForgeTrainingCheckpointStall",
        "expr": 'max by (job_id) (forge_trainer_agent_training_metric{metric="checkpoint_save_s"}) > 120',
        "for": "5m",
        "labels": {"severity": "ticket"},
        "annotations": {"summary": "job {{ $labels.job_id }} stalls {{ $value }} s per checkpoint save"},
    },
    {
        "alert": "ForgeServiceDown",
        "expr": 'up{job=~"forge-.*"} == 0',
        "for": "2m",
        "labels": {"severity": "page"},
        "annotations": {"summary": "{{ $labels.job }} is not answering /metrics"},
    },
]


def alert_rules() -> dict[str, Any]:
    return {"groups": [{"name": "forge-slo", "rules": ALERT_RULES}]}


def _p(quantile: float, metric: str, by: str, selector: str = "", window: str = "5m") -> str:
    return f"histogram_quantile({quantile}, sum by (le, {by}) (rate({metric}_bucket{selector}[{window}])))"


def _stage(stage: str) -> str:
    return '{stage="' + stage + '"}'


#: The serving, training and RAG boards: title -> [(panel title, expression, unit)], on the names
#: the gateway, the engines (vLLM and Forge's model server), the trainer agent, the retriever and
#: the reranker export.
BOARDS: dict[str, tuple[str, list[tuple[str, str, str]]]] = {
    "forge-gateway": (
        "Forge gateway",
        [
            (
                "Time to first token p50 / p99 by model (gateway)",
                f"{_p(0.5, 'forge_gateway_time_to_first_token_seconds', 'model')} "
                f"or {_p(0.99, 'forge_gateway_time_to_first_token_seconds', 'model')}",
                "s",
            ),
            (
                "Inter-token latency p50 / p99 by model (engines)",
                f"{_p(0.5, 'vllm:inter_token_latency_seconds', 'model_name')} "
                f"or {_p(0.99, 'vllm:inter_token_latency_seconds', 'model_name')}",
                "s",
            ),
            (
                "Shed requests/s by model and priority",
                "sum by (model, priority) (rate(forge_gateway_shed_total[1m]))",
                "reqps",
            ),
            ("Queue wait p99 by priority", _p(0.99, "forge_gateway_queue_wait_seconds", "priority"), "s"),
            ("Queue depth by model", "sum by (model) (forge_gateway_queue_depth)", "short"),
            ("API requests/s by status", "sum by (status) (rate(forge_gateway_requests_total[1m]))", "reqps"),
        ],
    ),
    "forge-training": (
        "Forge training",
        [
            ("Loss by job", 'max by (job_id) (forge_trainer_agent_training_metric{metric="loss"})', "short"),
            (
                "Tokens/s by job",
                'sum by (job_id) (forge_trainer_agent_training_metric{metric="tokens_per_s"})',
                "short",
            ),
            (
                "MFU by job",
                'max by (job_id) (forge_trainer_agent_training_metric{metric="mfu"})',
                "percentunit",
            ),
            (
                "Checkpoint stall (s per save) by job",
                'max by (job_id) (forge_trainer_agent_training_metric{metric="checkpoint_save_s"})',
                "s",
            ),
            ("Runs active by node", "sum by (instance) (forge_trainer_agent_runs_active)", "short"),
        ],
    ),
    "forge-rag": (
        "Forge RAG",
        [
            *(
                (
                    f"{stage.capitalize()} latency p50 / p99",
                    f"{_p(0.5, 'forge_gateway_rag_stage_seconds', 'stage', _stage(stage))} "
                    f"or {_p(0.99, 'forge_gateway_rag_stage_seconds', 'stage', _stage(stage))}",
                    "s",
                )
                for stage in ("retrieve", "rerank", "assemble")
            ),
            (
                "Response cache hit rate",
                'sum(rate(forge_gateway_response_cache_total{result="hit"}[5m])) / '
                'sum(rate(forge_gateway_response_cache_total{result=~"hit|miss"}[5m]))',
                "percentunit",
            ),
            (
                "Reranker score cache hit rate",
                'sum(rate(forge_reranker_cache_lookups_total{outcome="hit"}[5m])) / '
                "sum(rate(forge_reranker_cache_lookups_total[5m]))",
                "percentunit",
            ),
            (
                "RAG queries/s by outcome",
                "sum by (outcome) (rate(forge_gateway_rag_requests_total[1m]))",
                "reqps",
            ),
        ],
    ),
}


def _board(uid: str, title: str, panels: list[tuple[str, str, str]]) -> dict[str, Any]:
    return {
        "title": title,
        "uid": uid,
        "schemaVersion": 39,
        "time": {"from": "now-6h", "to": "now"},
        "panels": [
            {
                "id": i + 1,
                "type": "timeseries",
                "title": name,
                "gridPos": {"h": 8, "w": 12, "x": (i % 2) * 12, "y": (i // 2) * 8},
                "datasource": {"type": "prometheus", "uid": "prometheus"},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": [{"refId": "A", "expr": expr}],
            }
            for i, (name, expr, unit) in enumerate(panels)
        ],
    }


def dashboards() -> dict[str, dict[str, Any]]:
    """Every provisioned dashboard by file name: the overview and the serving, training and RAG boards."""
    files = {"forge-overview.json": grafana_dashboard()}
    files.update({f"{uid}.json": _board(uid, title, panels) for uid, (title, panels) in BOARDS.items()})
    return files


def grafana_dashboard() -> dict[str, Any]:
    """One overview dashboard: a row of panels per concern, all on the exported metric names."""
    panels = [
        ("gRPC requests/s by service", "sum by (service) (rate(forge_grpc_requests_total[1m]))"),
        ("GPU utilisation (scheduler)", "forge_scheduler_utilization"),
        ("Jain's fairness index", "forge_scheduler_jain_index"),
        (
            "Queue time p95 by team (s)",
            "histogram_quantile(0.95, sum by (le, team) (rate(forge_scheduler_queue_time_seconds_bucket[1h])))",
        ),
        ("Pending jobs by team", "sum by (team) (forge_scheduler_pending_jobs)"),
        (
            "gRPC p99 latency by service (s)",
            "histogram_quantile(0.99, sum by (le, service) (rate(forge_grpc_request_seconds_bucket[5m])))",
        ),
        ("gRPC server errors/s", 'sum by (service, code) (rate(forge_grpc_requests_total{code!="OK"}[1m]))'),
        (
            "Requests waiting / running (model servers)",
            "sum by (model_name) (vllm:num_requests_waiting) or sum by (model_name) (vllm:num_requests_running)",
        ),
        ("Outbox backlog by service", "max by (job) (forge_outbox_pending)"),
        (
            "Events consumed/s by group and outcome",
            "sum by (group, outcome) (rate(forge_events_consumed_total[1m]))",
        ),
    ]
    return {
        "title": "Forge overview",
        "uid": "forge-overview",
        "schemaVersion": 39,
        "time": {"from": "now-6h", "to": "now"},
        "panels": [
            {
                "id": i + 1,
                "type": "timeseries",
                "title": title,
                "gridPos": {"h": 8, "w": 12, "x": (i % 2) * 12, "y": (i // 2) * 8},
                "datasource": {"type": "prometheus", "uid": "prometheus"},
                "targets": [{"refId": "A", "expr": expr}],
            }
            for i, (title, expr) in enumerate(panels)
        ],
    }


def _alert(name: str, labels: dict[str, str], summary: str) -> dict[str, Any]:
    return {
        "eval_time": "",
        "alertname": name,
        "exp_alerts": [{"exp_labels": labels, "exp_annotations": {"summary": summary}}],
    }


#: ``promtool test rules deploy/prometheus/alerts.test.yml``: each alert fires on the series it is
#: meant for and stays quiet just below its threshold.
ALERT_TESTS: dict[str, Any] = {
    "rule_files": ["alerts.yml"],
    "evaluation_interval": "1m",
    "tests": [
        {
            "interval": "1m",
            "input_series": [
                # 10 shed for every 100 admitted: 9.1 % of requests.
                {"series": 'forge_gateway_shed_total{model="llama",priority="batch"}', "values": "0+10x30"},
                {"series": 'forge_gateway_queue_wait_seconds_count{priority="batch"}', "values": "0+100x30"},
                {
                    "series": 'up{job="forge-scheduler",instance="scheduler:8051"}',
                    "values": "1 1 0 0 0 0 0 0",
                },
                {
                    "series": 'up{job="forge-retriever",instance="retriever:8055"}',
                    "values": "1 1 1 1 1 1 1 1",
                },
                {
                    "series": 'forge_trainer_agent_training_metric{job_id="job-1",metric="checkpoint_save_s"}',
                    "values": "150x20",
                },
                {
                    "series": 'forge_trainer_agent_training_metric{job_id="job-2",metric="checkpoint_save_s"}',
                    "values": "30x20",
                },
                {"series": 'vllm:num_requests_waiting{model_name="llama"}', "values": "40x10"},
                {"series": 'vllm:num_requests_waiting{model_name="small"}', "values": "3x10"},
                # RAG retrieval: 9 of 10 searches between 0.5 s and 1 s.
                *(
                    {
                        "series": f'forge_gateway_rag_stage_seconds_bucket{{stage="retrieve",le="{le}"}}',
                        "values": values,
                    }
                    for le, values in (
                        ("0.1", "0+1x30"),
                        ("0.5", "0+1x30"),
                        ("1", "0+10x30"),
                        ("+Inf", "0+10x30"),
                    )
                ),
            ],
            "alert_rule_test": [
                {
                    **_alert(
                        "ForgeGatewayShedding", {"severity": "page"}, "the gateway sheds 9.091% of requests"
                    ),
                    "eval_time": "20m",
                },
                {
                    "eval_time": "5m",
                    "alertname": "ForgeGatewayShedding",
                    "exp_alerts": [],
                },  # not yet 10 minutes
                {
                    **_alert(
                        "ForgeServiceDown",
                        {"severity": "page", "job": "forge-scheduler", "instance": "scheduler:8051"},
                        "forge-scheduler is not answering /metrics",
                    ),
                    "eval_time": "6m",
                },
                {
                    **_alert(
                        "ForgeTrainingCheckpointStall",
                        {"severity": "ticket", "job_id": "job-1"},
                        "job job-1 stalls 150 s per checkpoint save",
                    ),
                    "eval_time": "10m",
                },
                {
                    **_alert(
                        "ForgeInferenceQueueBuilding",
                        {"severity": "ticket", "model_name": "llama"},
                        "llama has 40 requests waiting",
                    ),
                    "eval_time": "8m",
                },
                {
                    **_alert(
                        "ForgeRagRetrieveSlow", {"severity": "ticket"}, "RAG retrieval p99 above 500 ms"
                    ),
                    "eval_time": "20m",
                },
            ],
        },
        {
            # Quiet below every threshold: 0.5 % shed, fast retrieval, short checkpoint saves.
            "interval": "1m",
            "input_series": [
                {"series": 'forge_gateway_shed_total{model="llama",priority="batch"}', "values": "0+1x30"},
                {"series": 'forge_gateway_queue_wait_seconds_count{priority="batch"}', "values": "0+200x30"},
                *(
                    {
                        "series": f'forge_gateway_rag_stage_seconds_bucket{{stage="retrieve",le="{le}"}}',
                        "values": "0+10x30",
                    }
                    for le in ("0.1", "0.5", "1", "+Inf")
                ),
            ],
            "alert_rule_test": [
                {"eval_time": "25m", "alertname": name, "exp_alerts": []}
                for name in ("ForgeGatewayShedding", "ForgeRagRetrieveSlow", "ForgeTrainingCheckpointStall")
            ],
        },
    ],
}
