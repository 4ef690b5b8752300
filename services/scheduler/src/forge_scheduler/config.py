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

    cycle_interval_s: float = Field(default=1.0, gt=0, le=60)
    """Longest pause between scheduling cycles (a submit, report or new node wakes it sooner)."""

    node_lost_after_s: float = Field(default=15.0, gt=0)
    """A node silent this long is lost: its jobs go back to the queue."""

    preemption_grace_s: float = Field(default=30.0, ge=0)
    """Time a preempted job gets to checkpoint before its agent kills it."""

    usage_half_life_s: float = Field(default=7 * 86400.0, gt=0)
    """Half-life of the decayed usage behind fair share (Slurm's PriorityDecayHalfLife)."""
