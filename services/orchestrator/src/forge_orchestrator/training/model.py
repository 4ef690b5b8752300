"""The ``training`` workflow's input, result and checkpoint signal (plain data: Temporal carries
them), and the job's command line."""

from __future__ import annotations

from dataclasses import dataclass, field

from forge_experiments.jobcmd import TrainCommand
from forge_orchestrator.identity import Caller

#: Name of the signal carrying a published checkpoint of the workflow's job.
CHECKPOINT_SIGNAL = "checkpoint_published"


@dataclass
class CheckpointInfo:
    """Payload of the ``checkpoint_published`` signal (from ``CheckpointPublished``)."""

    job_id: str
    run_id: str
    step: int
    uri: str
    """The Hugging Face export (safetensors + config + tokenizer) of the checkpoint."""
    manifest_uri: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    event_id: str = ""


@dataclass
class TrainInput:
    """Input of the training workflow."""

    team: str
    recipe: str
    name: str = "train"
    overrides: list[str] = field(default_factory=list)
    """Recipe overrides, ``key=value`` (``--set`` of the training entry point)."""
    replicas: int = 1
    gpus_per_replica: int = 1
    gpu_type: str = ""
    priority_class: str = "normal"
    python: str = "python"
    """Interpreter on the nodes that runs the training entry point (:class:`forge_experiments.jobcmd.TrainCommand`)."""
    max_infra_retries: int = 3
    """Requeues after a lost node before the workflow gives up (preemptions do not count)."""
    timeout_s: float = 6 * 3600.0
    """How long the job may take from submission to SUCCEEDED."""
    checkpoint_wait_s: float = 120.0
    """How long to wait for the published checkpoint after the job succeeded."""
    labels: dict[str, str] = field(default_factory=dict)
    """Extra job labels, e.g. ``{"auto_eval": "false"}`` (``routing.AUTO_EVAL_LABEL``); ``workflow_id`` and ``recipe`` are set here."""
    caller: Caller | None = None
    """Who started the workflow (set by the orchestrator from the caller's token, never by the
    caller); None: an admin (a workflow started before callers were recorded)."""
    auto_eval: bool = True
    """Whether the job's checkpoint gets the automatic eval-and-promote; False for a caller that
    evaluates it itself (the RLHF loop, sweeps). Travels as the job's typed routing hints (an
    ``AUTO_EVAL_LABEL: "false"`` label in ``labels``, the older way, means the same)."""


@dataclass
class TrainResult:
    job_id: str
    states_seen: list[str] = field(default_factory=list)
    preemptions: int = 0
    infra_retries: int = 0
    checkpoint: CheckpointInfo | None = None
    elapsed_s: float = 0.0


def command_of(params: TrainInput) -> list[str]:
    return TrainCommand(params.recipe, tuple(params.overrides), params.python).argv()
