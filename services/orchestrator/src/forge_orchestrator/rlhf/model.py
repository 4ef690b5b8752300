"""What an RLHF loop is given and what it records of each round, and the rules it decides by:
the reward-model gate, the drift stop, the version names. Plain data and pure functions, so the
workflow (``workflow.py``) stays deterministic and the rules are tested on their own.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from forge_experiments.overoptimisation import overoptimised
from forge_experiments.rmlength import length_gate
from forge_orchestrator.promote.model import EvalAndPromoteInput

CHANCE = 0.5


@dataclass
class RlhfInput:
    """Input of the RLHF workflow."""

    policy_uri: str
    """The reference policy (a Hugging Face folder, e.g. an SFT checkpoint): the first round starts
    from it, reward models are initialised from it and drift is measured against it."""
    work_uri: str
    """Shared folder (path or object-store URL) where the round's evaluation jobs write results."""
    team: str = "rlhf"
    min_new_pairs: int = 64
    """Offline rounds (no ``sample_model``): accepted pairs recorded since the previous round's
    snapshot before a round starts."""
    poll_s: float = 30.0
    """First wait between two counts while buffering; it doubles up to ``max_poll_s``."""
    max_poll_s: float = 600.0
    """Longest wait between two counts (bounds the history: a week of buffering is ~1,000 polls)."""
    buffer_timeout_s: float = 7 * 86400.0
    """How long one round may wait for its preferences; then it ends ``stalled`` with the reason."""
    # --- online collection (on when sample_model is set) ---
    sample_model: str = ""
    """The current policy as the inference gateway serves it (a model name, ``name:version`` or an
    alias). Set: each round samples it on the prompt pool and queues the pairs for raters (online
    RLHF). Empty: rounds buffer on whatever preferences arrive (offline)."""
    prompt_dataset: str = "preferences/hh-rlhf/helpful-base/test.jsonl.gz"
    """The pool's dataset part: HH-RLHF lines (the prompt is the transcript before the last
    assistant turn), a path under the data folder."""
    dataset_prompts: int = 16
    production_prompts: int = 16
    """Production prompts of tenants that allow training (the gateway's pool), at most."""
    temperatures: list[float] = field(default_factory=lambda: [0.7, 1.3])
    """The two sampling temperatures of a comparison's responses."""
    sample_max_tokens: int = 32
    max_prompt_chars: int = 2000
    """Prompts of the pool longer than this are not drawn (a small policy's context is short)."""
    min_policy_pairs: int = 16
    """Accepted preferences on the round's own comparisons before it trains."""
    min_raters: int = 1
    """Distinct raters (not flagged by rater quality) who must have answered the round's comparisons."""
    shadow_alias: str = ""
    """The gateway alias whose canary shadow pairs (:mod:`.shadow`) the round also queues for
    raters, when that alias has a shadow; empty: ``sample_model`` when it is an alias name."""
    shadow_pairs: int = 100
    """Shadow pairs read per round, at most (1-500); 0: none."""
    # --- training ---
    heldout_fraction: float = 0.1
    reward_model_name: str = "rm-rlhf"
    reward_recipe: str = "reward_hh"
    reward_overrides: list[str] = field(default_factory=list)
    rm_length_gate: bool = True
    """Also refuse a reward model that judges length, not quality (:func:`round_gates`)."""
    rm_min_shorter_low: float = 0.5
    """The length gate: the 95 % interval of the accuracy on held-out pairs whose preferred reply
    is the shorter one must lie above this."""
    rm_min_shorter_n: int = 1
    """The length gate judges on at least this many such pairs (the interval widens with fewer)."""
    dpo_recipe: str = "dpo_hh"
    dpo_overrides: list[str] = field(default_factory=list)
    monitor_interval: int = 0
    """Every this many DPO steps, score KL to the reference, proxy reward (the round's pinned RM)
    and held-out human agreement, and stop training when over-optimisation shows; 0: off."""
    kl_budget: float = 20.0
    """Nats per response: a round whose policy is further from the reference than this stops."""
    overopt_window: int = 2
    """Stop when the proxy reward rose and held-out agreement fell over this many successive
    checkpoints (the reference counts as the first point)."""
    check_max_prompts: int = 32
    check_max_new_tokens: int = 24
    max_rounds: int = 1
    python: str = "python"
    """Interpreter on the nodes (it runs the trainer and the feedback package's evaluations)."""
    gpus_per_replica: int = 1
    gpu_type: str = ""
    job_timeout_s: float = 6 * 3600.0
    checkpoint_wait_s: float = 120.0
    promote: bool = True
    """Hand each accepted checkpoint to ``eval_and_promote`` (step 6)."""
    model_name: str = "policy-rlhf"
    promote_suite: str = EvalAndPromoteInput.suite
    """Suite of the hand-over; by default eval-and-promote's own (held-out perplexity)."""
    promote_limit: int = 50
    promote_tier: str = "smoke"
    promote_endpoint: str = ""


@dataclass
class DriftPoint:
    """One checkpoint's drift figures against the original reference, under the pinned RM."""

    policy: str
    kl: float
    sqrt_kl: float
    proxy_reward: float
    heldout_agreement: float


POINT_KEYS = ("policy", "kl", "sqrt_kl", "proxy_reward", "heldout_agreement")


@dataclass
class RoundRecord:
    round: int
    status: str = "running"
    """``running``, ``completed``, ``stopped`` (drift), ``rejected`` (a gate refused) or
    ``stalled`` (raters did not answer in time)."""
    step: str = "buffering"
    batch: str = ""
    """Online rounds: the batch its policy samples were queued under in the feedback service."""
    prompts: dict[str, int] = field(default_factory=dict)
    """Online rounds: prompts drawn by part of the pool (``dataset``, ``production``)."""
    queued: int = 0
    """Online rounds: comparisons of the policy's samples queued for raters."""
    shadow_queued: int = 0
    """Online rounds: comparisons of canary shadow pairs queued under the same batch."""
    new_pairs: int = 0
    snapshot_id: str = ""
    snapshot_uri: str = ""
    train_pairs: int = 0
    test_pairs: int = 0
    excluded_raters: dict[str, str] = field(default_factory=dict)
    reward_model: str = ""
    reward_model_uri: str = ""
    rm_accuracy: float = 0.0
    rm_ci95_low: float = 0.0
    rm_ci95_high: float = 0.0
    rm_n: int = 0
    policy_uri: str = ""
    training_monitor: list[dict[str, float]] = field(default_factory=list)
    """Every ``monitor_interval`` DPO steps: step, KL, proxy reward, held-out agreement."""
    early_stop: str = ""
    """Why DPO stopped before its last step (over-optimisation), empty when it ran to the end."""
    drift: list[DriftPoint] = field(default_factory=list)
    """Reference first, then the loop's policies up to this round's, under this round's RM."""
    reason: str = ""
    eval_workflow_id: str = ""
    decision: str = ""
    """``promoted`` or ``blocked`` (by eval-and-promote); empty when not handed on."""


@dataclass
class RlhfResult:
    rounds: list[RoundRecord] = field(default_factory=list)
    policy_uri: str = ""
    """The policy the loop ended with (the last promoted one, else the reference)."""
    ended: str = ""
    """Why the loop ended."""


ROUND_GATES: tuple[Callable[[dict[str, Any]], str], ...] = ()
"""Further checks of a round's ``forge rm eval`` summary after the accuracy gate, each returning why
the reward model may not be used (empty when it may): the place for the length-stratified gate
(accuracy where the preferred reply is the shorter one, :func:`round_gates`)."""


def round_gates(params: RlhfInput) -> tuple[Callable[[dict[str, Any]], str], ...]:
    """The gates of ``params``' rounds after the accuracy gate: with ``rm_length_gate``,
    :func:`forge_experiments.rmlength.length_gate` at ``rm_min_shorter_low`` / ``rm_min_shorter_n``."""
    if not params.rm_length_gate:
        return ROUND_GATES

    def by_length(summary: dict[str, Any]) -> str:
        return length_gate(
            summary, min_shorter_low=params.rm_min_shorter_low, min_shorter_n=params.rm_min_shorter_n
        )

    return (*ROUND_GATES, by_length)


def reward_gate(
    summary: dict[str, Any],
    chance: float = CHANCE,
    gates: tuple[Callable[[dict[str, Any]], str], ...] = ROUND_GATES,
) -> str:
    """Why a reward model may not be used (empty when it may): its held-out accuracy must beat
    ``chance`` significantly, i.e. the 95 % interval's lower end lies above it; then each of
    ``gates`` (:data:`ROUND_GATES`) must pass."""
    for key in ("accuracy", "ci95_low", "ci95_high", "n"):
        if key not in summary:
            return f"rm eval summary has no {key!r}"
    low = float(summary["ci95_low"])
    if low > chance:
        return next((why for why in (gate(summary) for gate in gates) if why), "")
    return (
        f"held-out pairwise accuracy {float(summary['accuracy']):.3f} "
        f"[{low:.3f}, {float(summary['ci95_high']):.3f}] on n={int(summary['n'])} human pairs does not "
        f"beat {chance:.0%} significantly (the 95% interval reaches {chance:.0%})"
    )


def drift_stop(points: list[DriftPoint], kl_budget: float, window: int) -> str:
    """Why the newest point ends the round (empty when it does not).

    1. KL budget: the newest policy is more than ``kl_budget`` nats from the reference.
    2. Over-optimisation: over the last ``window`` steps (``window + 1`` points) the proxy reward
       rose at every step while held-out human agreement fell at every step.
    """
    if not points:
        return ""
    newest = points[-1]
    if newest.kl > kl_budget:
        return f"KL to the reference {newest.kl:.3f} nats exceeds the budget {kl_budget:g}"
    if overoptimised([p.proxy_reward for p in points], [p.heldout_agreement for p in points], window):
        tail = points[-(window + 1) :]
        trace = ", ".join(
            f"sqrt(KL)={p.sqrt_kl:.3f}: proxy {p.proxy_reward:.3f}, agreement {p.heldout_agreement:.3f}"
            for p in tail
        )
        return (
            f"over-optimisation: proxy reward rose while held-out human agreement fell over the last "
            f"{window} checkpoint(s) ({trace})"
        )
    return ""


def stall_reason(
    accepted: int, need: int, raters: int, need_raters: int, answers: int, queued: int, waited_s: float
) -> str:
    """Why an online round's wait ended without enough preferences (empty when it has them)."""
    if accepted >= need and raters >= need_raters:
        return ""
    return (
        f"raters did not answer in time: {accepted} accepted preference(s) of {need} needed "
        f"({answers} answer(s) in all, from {raters} rater(s), {need_raters} needed) on the round's "
        f"{queued} policy comparison(s) within {waited_s:g}s"
    )


_VERSION_CHARS = re.compile(r"[^A-Za-z0-9._-]")


def rm_version(workflow_id: str, round_number: int) -> str:
    """A registry version unique to the round (so a retried registration finds its own)."""
    return f"{_VERSION_CHARS.sub('-', workflow_id)[:48]}.r{round_number}"


def round_batch(workflow_id: str, round_number: int) -> str:
    """The feedback service's batch of the round's policy samples (its batch-name alphabet)."""
    return f"{re.sub(r'[^A-Za-z0-9._:@-]', '-', workflow_id)[:100]}/r{round_number}"


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts])
