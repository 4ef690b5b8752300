"""What the orchestrator's API checks before it starts a smoke job."""

from __future__ import annotations

from forge_kit import errors
from forge_orchestrator.smoke.model import SmokeInput


def validate_smoke(params: SmokeInput) -> None:
    if not params.team:
        raise errors.ValidationError("input.team", "must not be empty")
    if not 0 < params.timeout_s <= 3600:
        raise errors.ValidationError("input.timeout_s", "must be > 0 and at most 3600")
    if not 0 <= params.hold_s <= 3600:
        raise errors.ValidationError("input.hold_s", "must be between 0 and 3600")
