"""The guarded canary's traffic through a real Prometheus: where the gateway runs as several
replicas behind one Service (Kubernetes), the orchestrator reads every replica's counters, summed,
from the Prometheus server that scrapes them (``GATEWAY_METRICS_PROMETHEUS_URL``, its federation
endpoint), and counts what it would count reading each replica's ``/metrics`` itself.

Two replicas' ``/metrics`` here serve the gateway's own metric objects (its default registry, so
both hold the same counters and the sum is twice one replica's); Debian's ``prometheus`` scrapes
them every second."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client import REGISTRY, start_http_server

from forge_experiments.canary import parse_metrics
from forge_inference_gateway.routing.router import EMPTY_ANSWERS, ITL, TTFT, UPSTREAM_REQUESTS
from forge_kit.testing.processes import free_port, wait_for_port
from forge_kit.testing.requires import missing
from forge_orchestrator.config import OrchestratorSettings
from forge_orchestrator.promote.canary_activities import CanaryActivities, SnapshotInput

pytestmark = pytest.mark.integration


@pytest.fixture
def replicas() -> Iterator[list[str]]:
    """Two gateway replicas' ``/metrics`` addresses."""
    servers = [start_http_server(free_port(), addr="127.0.0.1", registry=REGISTRY) for _ in range(2)]
    try:
        yield [f"127.0.0.1:{server.server_port}" for server, _ in servers]
    finally:
        for server, thread in servers:
            server.shutdown()
            thread.join(5)


@pytest.fixture
def prometheus(tmp_path: Path, replicas: list[str]) -> Iterator[str]:
    binary = shutil.which("prometheus")
    if binary is None:
        missing("prometheus is not installed (Debian package prometheus; `make test` installs it as root)")
    config = tmp_path / "prometheus.yml"
    scrape = {"job_name": "gateway", "static_configs": [{"targets": replicas}]}
    config.write_text(yaml.safe_dump({"global": {"scrape_interval": "1s"}, "scrape_configs": [scrape]}))
    port = free_port()
    with (tmp_path / "prometheus.log").open("wb") as log:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--web.listen-address=127.0.0.1:{port}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for_port(port, 60, proc)  # type: ignore[arg-type]
            yield f"http://127.0.0.1:{port}"
        finally:
            proc.terminate()
            proc.wait(10)


async def test_the_canary_counts_every_gateway_replica_through_prometheus(
    prometheus: str, replicas: list[str]
) -> None:
    name = f"fed-{uuid.uuid4().hex[:8]}"
    canary, stable = (f"{name}:2", "canary"), (f"{name}:1", "stable")
    for i in range(20):
        UPSTREAM_REQUESTS.labels(*canary, "200" if i % 5 else "500").inc()
        TTFT.labels(*canary).observe(0.004 * (i % 9))
        ITL.labels(*canary).observe(0.001 * (i % 4))
    EMPTY_ANSWERS.labels(*canary).inc(2)
    UPSTREAM_REQUESTS.labels(*stable, "200").inc(30)
    UPSTREAM_REQUESTS.labels(*stable, "timeout").inc(1)
    TTFT.labels(*stable).observe(0.02)

    direct = CanaryActivities([f"http://{t}/metrics" for t in replicas])
    settings = OrchestratorSettings(gateway_metrics_prometheus_url=prometheus)
    federated = CanaryActivities(settings.canary_metrics_urls())
    ask = SnapshotInput(canary=canary[0], production=stable[0])
    want = await direct.canary_snapshot(ask)
    assert want.canary.statuses == {"200": 32.0, "500": 8.0} and want.canary.empty == 4.0
    assert want.canary.ttft["+Inf"] == 40.0 and want.production.statuses == {"200": 60.0, "timeout": 2.0}
    deadline = time.monotonic() + 60
    while (got := await federated.canary_snapshot(ask)) != want:
        assert time.monotonic() < deadline, f"Prometheus gave {got}, the replicas {want}"
        await asyncio.sleep(0.5)
    # Only the canary's series travel: the federation query names them.
    text = httpx.get(settings.canary_metrics_urls()[0]).text
    assert "forge_gateway_upstream_seconds" not in text and "process_cpu_seconds" not in text
    assert parse_metrics(text, [canary])[canary].requests().n == 40


@pytest.mark.parametrize(
    ("settings", "refusal"),
    [
        (
            {
                "gateway_metrics_prometheus_url": "http://prometheus:9090",
                "gateway_metrics_urls": ["http://g/metrics"],
            },
            "set one",
        ),
        ({"gateway_metrics_prometheus_url": "file:///etc/passwd"}, "is not an http"),
    ],
)
def test_one_canary_metrics_source_an_http_one(settings: dict[str, object], refusal: str) -> None:
    with pytest.raises(ValueError, match=refusal):
        OrchestratorSettings(**settings)  # type: ignore[arg-type]
    assert OrchestratorSettings().canary_metrics_urls() == []
