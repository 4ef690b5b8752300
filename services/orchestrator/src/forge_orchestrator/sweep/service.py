"""What the orchestrator's API checks before it starts a sweep, and the memo it gives one."""

from __future__ import annotations

from forge_experiments import sweepspace
from forge_kit import errors
from forge_orchestrator.sweep.workflow import MEMO_METRIC, SweepInput


def validate_sweep(params: SweepInput) -> None:
    """Refuse a bad space before any job exists; the error names the field (``input.space.…``)."""
    try:
        space = sweepspace.parse(params.space)
    except errors.ValidationError as exc:
        raise errors.ValidationError(f"input.space.{exc.field}", exc.message.split(": ", 1)[-1]) from None
    if not params.team:
        raise errors.ValidationError("input.team", "must not be empty")
    if space.team and space.team != params.team:
        raise errors.ValidationError(
            "input.space.team", f"is {space.team!r} but the sweep is started for team {params.team!r}"
        )
    if not 0 <= params.max_infra_retries <= 100:
        raise errors.ValidationError("input.max_infra_retries", "must be between 0 and 100")


def sweep_memo(params: SweepInput) -> dict[str, str]:
    """The metric the sweep follows, for the metrics consumer."""
    return {MEMO_METRIC: sweepspace.parse(params.space).metric}
