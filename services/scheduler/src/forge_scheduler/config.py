"""Scheduler settings (env prefix ``FORGE_SCHEDULER_``)."""

from __future__ import annotations

from pydantic import Field

from forge_kit.settings import ServiceSettings, service_config


class SchedulerSettings(ServiceSettings):
    """Settings of the scheduler process."""

    model_config = service_config("scheduler")

    grpc_port: int = Field(default=50051, ge=0, le=65535)
    """gRPC port of the SchedulerService."""

    http_port: int = Field(default=8051, ge=0, le=65535)
    """HTTP port for health and metrics."""

    heartbeat_interval_s: int = Field(default=5, ge=1)
    """How often agents heartbeat; a node missing three is marked NOT_READY."""

    watch_queue_size: int = Field(default=1000, ge=1)
    """Updates buffered per WatchJobs stream before the slow watcher is dropped."""

    max_page_size: int = Field(default=500, ge=1)
    """Upper bound on page_size in list calls."""
