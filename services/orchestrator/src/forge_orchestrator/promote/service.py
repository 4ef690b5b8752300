"""What the orchestrator's API checks before it starts an eval-and-promote (the tier and the
canary policy's name are checked by :class:`~forge_orchestrator.promote.model.EvalAndPromoteInput`
itself)."""

from __future__ import annotations

import re

from forge_kit import errors
from forge_orchestrator.promote.model import EvalAndPromoteInput

_MODEL_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def validate_eval_and_promote(params: EvalAndPromoteInput) -> None:
    for name in ("model_name", "model_version"):
        if not _MODEL_PART.match(getattr(params, name)):
            raise errors.ValidationError(f"input.{name}", "must be 1-128 letters, digits, '.', '_' or '-'")
    if not params.uri:
        raise errors.ValidationError("input.uri", "must not be empty")
    if not params.suite:
        raise errors.ValidationError("input.suite", "must not be empty")
    if not 0 <= params.limit <= 100_000:
        raise errors.ValidationError("input.limit", "must be between 0 and 100000")
    if not 0 <= params.canary_percent <= 100:
        raise errors.ValidationError("input.canary_percent", "must be between 0 and 100")
    if not 0.1 <= params.poll_s <= 600:
        raise errors.ValidationError("input.poll_s", "must be between 0.1 and 600")
    if not 1 <= params.run_timeout_s <= 7 * 86400:
        raise errors.ValidationError("input.run_timeout_s", "must be between 1 and 604800")
