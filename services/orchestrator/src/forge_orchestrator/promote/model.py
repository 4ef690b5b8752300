"""The ``eval_and_promote`` workflow's input and result (plain data: Temporal carries them), and how a
model name becomes a canary policy family."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from forge_kit import errors

#: Eval tiers: ``full`` scores the suite (up to ``limit``), ``smoke`` each task's small stratified
#: subset (eval's ``RunSuite`` accepts exactly these).
TIERS = ("full", "smoke")

_NOT_FAMILY = re.compile(r"[^a-z0-9_.-]+")


def policy_family(model_name: str) -> str:
    """A model name as a policy family (a file name): lower case, other characters as ``-``."""
    return _NOT_FAMILY.sub("-", model_name.lower()).strip("-.")[:64] or "default"


@dataclass
class EvalAndPromoteInput:
    """A candidate checkpoint to evaluate and, if it holds up against production, promote."""

    model_name: str
    model_version: str
    uri: str
    """Where the checkpoint lives: a local Hugging Face folder (served for the run), or an object
    store URL when ``endpoint`` serves it."""
    suite: str = "tinyshakespeare_ppl"
    limit: int = 50
    """Examples of the suite to score (0: all); both models are scored on the same ones."""
    seed: int = 0
    endpoint: str = ""
    """OpenAI-compatible endpoint serving both models; empty: a model server eval starts for each
    model's checkpoint (``serve_model``), or eval's default endpoint (the gateway) without it."""
    canary_percent: int = 0
    """The canary's share of the production aliases' traffic; 0: the canary policy's."""
    canary_policy: str = ""
    """Policy family (``policies/canary/<family>.yaml``, else ``default.yaml``); empty: the
    orchestrator's ``canary_policy`` setting, else the model's name."""
    poll_s: float = 2.0
    run_timeout_s: float = 3600.0
    tier: str = "full"
    """``full`` or ``smoke``: each task's small stratified subset, for when compute is short."""
    serve_model: bool = True
    """With no ``endpoint``, evaluate each model on a model server started for its run."""
    training_run_id: str = ""
    recipe_hash: str = ""
    data_hash: str = ""
    parent: str = ""
    """Lineage recorded in the registry; ``parent`` is a registered ``name:version``."""

    def __post_init__(self) -> None:
        # Checked on construction, so an unknown tier is refused when the workflow is started
        # (INVALID_ARGUMENT naming ``input.tier``), not minutes later by eval's RunSuite.
        if self.tier not in TIERS:
            raise errors.ValidationError(
                "input.tier", f"must be one of {', '.join(TIERS)}, got {self.tier!r}"
            )
        if self.canary_policy and policy_family(self.canary_policy) != self.canary_policy:
            raise errors.ValidationError(
                "input.canary_policy", "must be 1-64 of a-z, 0-9, '.', '_', '-' (a policy file's name)"
            )


@dataclass
class EvalAndPromoteResult:
    candidate_run_id: str
    baseline_run_id: str = ""
    baseline: str = ""
    """The production model it was compared with, ``name:version``; empty for the first model."""
    verdict: str = ""
    promoted_to: list[str] = field(default_factory=list)
    blocked_reason: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    intervals: dict[str, list[float]] = field(default_factory=dict)
    """The candidate's 95% interval per metric (wider for the smoke tier)."""
    tier: str = "full"
    report_path: str = ""
    """The comparison report when compared with production, else the candidate run's report."""
    decision: str = ""
    """``promoted``, ``blocked`` (by the eval comparison, or its replicas not ready in time) or
    ``rolled_back`` (by the canary)."""
    canary: dict[str, Any] = field(default_factory=dict)
    """The guarded canary's decision, reason, timing, traffic and evidence (JSON)."""
    deployment: str = ""
    """The deployment serving the candidate (empty: promotions roll no replicas here)."""
    drained: list[str] = field(default_factory=list)
    """Deployments of the losing version that were drained and undeployed."""
