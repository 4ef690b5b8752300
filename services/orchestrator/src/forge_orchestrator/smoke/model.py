"""The ``smoke`` workflow's input and result (plain data: Temporal carries them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from forge_orchestrator.identity import Caller


@dataclass
class SmokeInput:
    """Input of the platform smoke workflow."""

    team: str = "smoke"
    """Team the smoke job is submitted under; created when missing."""
    timeout_s: float = 60.0
    """How long to wait for each expected job event before failing."""
    hold_s: float = 0.0
    """How long to keep the job queued (a durable timer) between its PENDING event and cancelling it."""
    caller: Caller | None = None
    """Who started the workflow (set by the orchestrator from the caller's token); None: an admin."""


@dataclass
class SmokeResult:
    """Output of the platform smoke workflow."""

    job_id: str
    states_seen: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
