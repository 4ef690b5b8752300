"""The RLHF worker: its settings and the Temporal worker that runs the ``rlhf`` loop.

The loop and its children (``training``, ``rlhf_job``, ``eval_and_promote``) run on their own
task queue, ``<task queue>-rlhf``, so the main worker's registrations stay as they are; child
workflows inherit the parent's queue. Job events and checkpoints reach the children by workflow
id (the job's ``workflow_id`` label), whatever their queue.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Any

from temporalio.client import Client
from temporalio.worker import Interceptor, Worker

from forge_experiments import recipecatalog
from forge_kit import errors
from forge_kit.settings import ForgeSettings, service_config
from forge_orchestrator.activities import SchedulerActivities
from forge_orchestrator.deploy.promotion import PromotionActivities
from forge_orchestrator.eval_activities import EvalActivities
from forge_orchestrator.promote.canary_activities import CanaryActivities
from forge_orchestrator.promote.model import TIERS
from forge_orchestrator.rlhf.activities import RlhfActivities
from forge_orchestrator.rlhf.sampling import RlhfSampler
from forge_orchestrator.rlhf.shadow import MAX_PAIRS, alias_name
from forge_orchestrator.rlhf.workflow import RLHF_WORKFLOWS, RlhfInput


class RlhfSettings(ForgeSettings):
    """Settings of the orchestrator's RLHF worker (env prefix ``FORGE_RLHF_``). The worker reaches
    the preference-feedback service at the orchestrator's ``preference_feedback_target`` with its
    ``preference_feedback_token`` (``FORGE_ORCHESTRATOR_PREFERENCE_FEEDBACK_*``, which the
    platform table sets)."""

    model_config = service_config("rlhf")

    enabled: bool = True
    """Run the RLHF worker in the orchestrator process; when off, StartWorkflow refuses ``rlhf``."""

    gateway_url: str = "http://127.0.0.1:8080"
    """HTTP address of the inference gateway (``forge up``'s by default), whose admin API lists the
    production part of the prompt pool (prompts of tenants that allow training), called with the
    orchestrator's ``inference_gateway_token``; empty: online rounds draw dataset prompts only.
    Samples go through the gateway's gRPC API (``inference_gateway_target``)."""


def rlhf_task_queue(task_queue: str) -> str:
    return f"{task_queue}-rlhf"


def build_rlhf_worker(
    client: Client,
    task_queue: str,
    scheduler: SchedulerActivities,
    evals: EvalActivities,
    rlhf: RlhfActivities,
    sampler: RlhfSampler,
    canary: CanaryActivities | None = None,
    promotions: PromotionActivities | None = None,
    *,
    guard: Interceptor | None,
) -> Worker:
    """A worker on :func:`rlhf_task_queue` (``task_queue``) for the loop, its children and their activities."""
    methods: list[Callable[..., Any]] = [
        scheduler.ensure_team,
        scheduler.submit_job,
        scheduler.cancel_job,
        evals.register_model,
        evals.current_model,
        evals.model_uri,
        evals.run_suite,
        evals.get_run,
        evals.compare_runs,
        evals.promote_model,
        evals.rollout_state,
        evals.decide_rollout,
        *(canary or CanaryActivities()).methods(),
        # A round's eval_and_promote child rolls replicas as the main queue's does (deploy/rollout).
        *(promotions or PromotionActivities()).methods(),
        rlhf.preference_stats,
        rlhf.batch_stats,
        sampler.queue_policy_samples,
        sampler.shadows.queue_shadow_pairs,
        rlhf.export_snapshot,
        rlhf.register_reward_model,
        rlhf.set_reward_model_status,
        rlhf.record_round,
        rlhf.read_json,
    ]
    return Worker(
        client,
        task_queue=rlhf_task_queue(task_queue),
        workflows=list(RLHF_WORKFLOWS),
        activities=methods,
        interceptors=[guard] if guard is not None else [],
    )


def validate_rlhf(params: RlhfInput) -> None:
    """The RLHF input's check for the workflow API (``service.KINDS``): names the bad field."""
    if not params.policy_uri:
        raise errors.ValidationError(
            "input.policy_uri", "must name the reference policy (a Hugging Face folder)"
        )
    if not params.work_uri:
        raise errors.ValidationError(
            "input.work_uri", "must name a folder the jobs and the orchestrator share"
        )
    if not params.team:
        raise errors.ValidationError("input.team", "must not be empty")
    if not 1 <= params.min_new_pairs <= 10_000_000:
        raise errors.ValidationError("input.min_new_pairs", "must be between 1 and 10000000")
    if not 0.1 <= params.poll_s <= params.max_poll_s <= 86400:
        raise errors.ValidationError("input.poll_s", "need 0.1 <= poll_s <= max_poll_s <= 86400")
    _validate_online(params)
    if not 0.0 < params.heldout_fraction < 1.0:
        raise errors.ValidationError("input.heldout_fraction", "must be in (0, 1)")
    if not 0.0 <= params.rm_min_shorter_low < 1.0:
        raise errors.ValidationError("input.rm_min_shorter_low", "must be in [0, 1)")
    if params.rm_min_shorter_n < 1:
        raise errors.ValidationError("input.rm_min_shorter_n", "must be at least 1")
    if not params.kl_budget > 0:
        raise errors.ValidationError("input.kl_budget", "must be positive (nats per response)")
    if not 1 <= params.overopt_window <= 100:
        raise errors.ValidationError("input.overopt_window", "must be between 1 and 100")
    if not 1 <= params.max_rounds <= 1000:
        raise errors.ValidationError("input.max_rounds", "must be between 1 and 1000")
    for name in ("reward_overrides", "dpo_overrides"):
        for i, pair in enumerate(getattr(params, name)):
            key = pair.partition("=")[0]
            if "=" not in pair or not key:
                raise errors.ValidationError(f"input.{name}[{i}]", "must be KEY=VALUE")
            if key in ("init.parent", "pairs.path") or key.startswith("dpo.monitor."):
                raise errors.ValidationError(
                    f"input.{name}[{i}]",
                    f"{key} is set by the loop (the policy, the round's snapshot, the monitor)",
                )
        recipe = "reward_recipe" if name == "reward_overrides" else "dpo_recipe"
        recipecatalog.check_overrides(
            getattr(params, recipe), getattr(params, name), f"input.{name}", f"input.{recipe}"
        )
    if not 1 <= params.check_max_prompts <= 10_000:
        raise errors.ValidationError("input.check_max_prompts", "must be between 1 and 10000")
    if not 1 <= params.check_max_new_tokens <= 4096:
        raise errors.ValidationError("input.check_max_new_tokens", "must be between 1 and 4096")
    if params.promote and not params.promote_suite:
        raise errors.ValidationError("input.promote_suite", "must name the suite of the hand-over")
    if params.promote_tier not in TIERS:
        raise errors.ValidationError("input.promote_tier", f"must be one of {', '.join(TIERS)}")


def _validate_online(params: RlhfInput) -> None:
    """The online round's inputs: sizes in range, the dataset a relative path inside the data folder."""
    if len(params.sample_model) > 255 or any(c.isspace() for c in params.sample_model):
        raise errors.ValidationError(
            "input.sample_model", "must be a model name without spaces, at most 255 characters"
        )
    if params.shadow_alias and not alias_name(params.shadow_alias):
        raise errors.ValidationError(
            "input.shadow_alias", "must be 1-64 of a-z, 0-9, '.', '_', '-' (an alias)"
        )
    if not 0 <= params.shadow_pairs <= MAX_PAIRS:
        raise errors.ValidationError("input.shadow_pairs", f"must be between 0 and {MAX_PAIRS}")
    dataset = PurePosixPath(params.prompt_dataset)
    if (
        not params.prompt_dataset
        or dataset.is_absolute()
        or ".." in dataset.parts
        or "\\" in params.prompt_dataset
    ):
        raise errors.ValidationError("input.prompt_dataset", "must be a relative path inside the data folder")
    for name, low, high in (
        ("dataset_prompts", 0, 1000),
        ("production_prompts", 0, 1000),
        ("sample_max_tokens", 1, 2048),
        ("max_prompt_chars", 16, 100_000),
        ("min_policy_pairs", 1, 1_000_000),
        ("min_raters", 1, 1000),
        ("monitor_interval", 0, 100_000),
    ):
        if not low <= getattr(params, name) <= high:
            raise errors.ValidationError(f"input.{name}", f"must be between {low} and {high}")
    if params.sample_model and params.dataset_prompts + params.production_prompts == 0:
        raise errors.ValidationError(
            "input.dataset_prompts", "an online round needs prompts from some part of the pool"
        )
    if len(params.temperatures) != 2 or not all(0.0 <= t <= 2.0 for t in params.temperatures):
        raise errors.ValidationError("input.temperatures", "must be two temperatures in [0, 2]")
    if params.temperatures[0] == params.temperatures[1]:
        raise errors.ValidationError("input.temperatures", "must differ (the two samples of a comparison)")
    if not 1.0 <= params.buffer_timeout_s <= 30 * 86400:
        raise errors.ValidationError("input.buffer_timeout_s", "must be between 1 s and 30 days")
