"""What the orchestrator's API checks before it starts a training run."""

from __future__ import annotations

import re

from forge_experiments import recipecatalog
from forge_kit import errors
from forge_orchestrator.training.model import TrainInput

_RECIPE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def validate_train(params: TrainInput) -> None:
    """Refuse a bad run before its job is queued; the error names the field (``input.…``)."""
    if not _RECIPE.match(params.recipe):
        raise errors.ValidationError("input.recipe", "must be 1-128 letters, digits, '.', '_' or '-'")
    if not params.team:
        raise errors.ValidationError("input.team", "must not be empty")
    # The job's own rules from the catalogue: a typo is refused here, not on a node after queueing.
    recipecatalog.check_overrides(params.recipe, params.overrides, "input.overrides", "input.recipe")
    if not 1 <= params.replicas <= 1024:
        raise errors.ValidationError("input.replicas", "must be between 1 and 1024")
    if not 0 <= params.gpus_per_replica <= 64:
        raise errors.ValidationError("input.gpus_per_replica", "must be between 0 and 64")
    if not 0 <= params.max_infra_retries <= 100:
        raise errors.ValidationError("input.max_infra_retries", "must be between 0 and 100")
    if not 1 <= params.timeout_s <= 30 * 86400:
        raise errors.ValidationError("input.timeout_s", "must be between 1 and 2592000")
    if not 0 <= params.checkpoint_wait_s <= 86400:
        raise errors.ValidationError("input.checkpoint_wait_s", "must be between 0 and 86400")
    for key in params.labels:
        if not key or key in ("workflow_id", "recipe"):
            raise errors.ValidationError(
                f"input.labels.{key}", "must be a non-empty key other than workflow_id and recipe (set here)"
            )
