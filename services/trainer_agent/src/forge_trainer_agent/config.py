"""Trainer agent settings (env prefix ``FORGE_TRAINER_AGENT_``)."""

from __future__ import annotations

import socket
from typing import Literal

from pydantic import Field, SecretStr, field_validator

from forge_kit.settings import ServiceSettings, service_config
from forge_trainer_agent.node import GpuSpecError, parse_gpu_spec


class TrainerAgentSettings(ServiceSettings):
    """Settings of one node's trainer agent."""

    model_config = service_config("trainer_agent")

    grpc_port: int = Field(default=50052, ge=0, le=65535)
    """gRPC port of the TrainerAgentService."""

    http_port: int = Field(default=8052, ge=0, le=65535)
    """HTTP port for health and metrics."""

    node_name: str = Field(default_factory=socket.gethostname, min_length=1)
    """Name the node registers under; re-registering with the same name resumes the node."""

    gpus: str = ""
    """Simulated GPUs, e.g. ``H100x8:81559`` or ``A100-80GBx4,L4x2`` (TYPE[xCOUNT][:MEMORY_MB]);
    when set it replaces detection, when empty the node's real GPUs are reported (NVML, else
    torch.cuda; ``forge_trainer_agent.gpus``)."""

    node_group: str = ""
    """Topology: node group (a block of nodes behind one switch)."""

    rack: str = ""
    """Topology: rack."""

    nvlink_domain: str = ""
    """Topology: NVLink domain."""

    advertise_address: str = Field(default="", max_length=253, pattern=r"^[A-Za-z0-9.:-]*$")
    """Address other nodes reach this node's jobs at: a multi-node job's rendezvous (torchrun's
    c10d store, NCCL's bootstrap) listens on its rank-0 node, and the scheduler hands this address
    to every replica as ``MASTER_ADDR`` (node label ``forge.ai/address``). Empty: 127.0.0.1, every
    agent on one host (``forge up``). Kubernetes sets the pod IP; Compose the service name."""

    scheduler_target: str = "127.0.0.1:50051"
    """host:port of the scheduler's gRPC server (SchedulerService.AgentSession)."""

    scheduler_token: SecretStr = SecretStr("")
    """Bearer token presented to the scheduler."""

    register_timeout_s: float = Field(default=10.0, gt=0)
    """How long to wait for the scheduler's RegisterAck before reconnecting."""

    reconnect_initial_s: float = Field(default=0.5, gt=0)
    """First reconnect delay after the session to the scheduler drops; doubles per failure."""

    reconnect_max_s: float = Field(default=30.0, gt=0)
    """Cap of the (jittered) reconnect delay."""

    stop_grace_s: float = Field(default=30.0, ge=0)
    """Seconds a job has to exit after SIGTERM on CancelJob, on PreemptJob without grace_seconds,
    and when it exceeds max_runtime_seconds, before it is killed."""

    shutdown_grace_s: float = Field(default=5.0, ge=0)
    """Seconds running jobs get to exit (they are preempted) when the agent itself stops."""

    runner: Literal["local", "torchrun"] = "local"
    """How a job's command is started: as is, or under torchrun (one worker per assigned GPU)."""

    max_page_size: int = Field(default=500, ge=1)
    """Upper bound on page_size in ListRuns."""

    job_sandbox: str = "/usr/bin/bwrap"
    """The bubblewrap binary jobs run in (Debian package ``bubblewrap``); empty turns job
    isolation off (an explicit choice: the agent then says so loudly at start-up and to the
    scheduler, and runs only jobs that admins submitted unless ``allow_unisolated_jobs`` is set).
    Set but unusable (missing, or the agent is not root), the agent refuses to start unless
    ``allow_unisolated_jobs`` is set."""

    job_uid: int = Field(default=65534, ge=1, le=2**31 - 1)
    """Host user id jobs run as (``nobody`` by default); never 0."""

    job_gid: int = Field(default=65534, ge=1, le=2**31 - 1)
    """Host group id jobs run as, with no supplementary groups; never 0."""

    job_read_paths: str = ""
    """Comma-separated host folders jobs may read (e.g. other jobs' run directories), besides the
    Python runtime, the code on the agent's ``sys.path``, the data folder's datasets and the
    object store; glob patterns are expanded at each launch and missing folders left out."""

    job_write_paths: str = ""
    """Comma-separated host folders jobs may write besides their run directory and their
    ``checkpoints/<job id>`` in a local object store (e.g. a shared results folder); created when
    missing and handed to the job user."""

    allow_unisolated_jobs: bool = False
    """Run jobs of non-admin submitters even when this node cannot isolate them (they would see
    the agent's user and files): an explicit operator choice."""

    @field_validator("gpus")
    @classmethod
    def _gpus_readable(cls, value: str) -> str:
        try:
            parse_gpu_spec(value)
        except GpuSpecError as exc:
            raise ValueError(str(exc)) from None
        return value
