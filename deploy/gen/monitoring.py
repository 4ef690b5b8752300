"""Monitoring: the Prometheus scrape configuration, the SLO alerting rules and the Grafana dashboard."""

from __future__ import annotations

from typing import Any

from forge_cli.platform import SERVICES

from .common import host


def prometheus() -> dict[str, Any]:
    return {
        "global": {"scrape_interval": "15s", "evaluation_interval": "15s"},
        "rule_files": ["alerts.yml"],
        "scrape_configs": [
            {
                "job_name": f"forge-{host(spec)}",
                "metrics_path": "/metrics",
                # Compose host names; in Kubernetes the same names resolve inside the forge namespace.
                "static_configs": [
                    {"targets": [f"{host(spec)}:{spec.http_port}"], "labels": {"service": spec.name}}
                ],
            }
            for spec in SERVICES
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
        "alert": "ForgeServiceDown",
        "expr": 'up{job=~"forge-.*"} == 0',
        "for": "2m",
        "labels": {"severity": "page"},
        "annotations": {"summary": "{{ $labels.job }} is not answering /metrics"},
    },
]


def alert_rules() -> dict[str, Any]:
    return {"groups": [{"name": "forge-slo", "rules": ALERT_RULES}]}


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
