"""Input checks of the scheduler's domain: names, job specs, quotas. Each names the field."""

from __future__ import annotations

import re

from forge_kit import errors
from forge_kit.validate import check_finite, check_labels
from forge_scheduler.jobspec import GPU_KINDS, JobSpec
from forge_scheduler.records import QuotaSpec

MAX_DURATION_S = 90 * 86400
PRIORITY_CLASSES = ("production", "high", "normal", "preemptible")
_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


def validate_name(field_name: str, value: str) -> None:
    """Team and job names are DNS-label-like so they can become resource names downstream."""
    if not value:
        raise errors.ValidationError(field_name, "must not be empty")
    if not _NAME.match(value):
        raise errors.ValidationError(
            field_name, "must be lowercase letters, digits and '-', at most 63 characters"
        )


def validate_spec(spec: JobSpec) -> None:
    """Reject a spec the scheduler could never run, naming the field (by its name in the API)."""
    validate_name("spec.name", spec.name)
    validate_name("spec.team", spec.team)
    durations = {
        "max_runtime_seconds": spec.max_runtime_s,
        "min_runtime_seconds": spec.min_runtime_s,
        "checkpoint_interval_seconds": spec.checkpoint_interval_s,
    }
    for name, value in durations.items():
        if value > MAX_DURATION_S:
            raise errors.ValidationError(f"spec.{name}", f"must be at most {MAX_DURATION_S} (90 days)")
    if spec.max_runtime_s and spec.min_runtime_s > spec.max_runtime_s:
        raise errors.ValidationError("spec.min_runtime_seconds", "must not exceed max_runtime_seconds")
    if spec.priority_class not in PRIORITY_CLASSES:
        raise errors.ValidationError("spec.priority_class", f"must be one of {', '.join(PRIORITY_CLASSES)}")
    if spec.gpus_per_replica == 0 and spec.kind in GPU_KINDS:
        raise errors.ValidationError(
            "spec.resources.gpu_count", f"must be at least 1 for a {spec.kind.value} job"
        )
    if spec.gpus_per_replica > 0 and not spec.gpu_type:
        raise errors.ValidationError("spec.resources.gpu_type", "is required when gpu_count > 0")
    if spec.gpus_per_replica > 64:
        raise errors.ValidationError("spec.resources.gpu_count", "must be at most 64 per replica")
    if spec.replicas > 1024:
        raise errors.ValidationError("spec.replicas", "must be at most 1024")
    if not spec.command:
        raise errors.ValidationError("spec.command", "must not be empty")
    check_labels("spec.labels", spec.labels)


#: Largest fair-share weight: far beyond any real ratio, and finite (NaN or infinity would
#: make every share comparison false).
MAX_QUOTA_WEIGHT = 1e6


def validate_quota(path: str, quota: QuotaSpec) -> None:
    if not quota.gpu_type:
        raise errors.ValidationError(f"{path}.gpu_type", "must not be empty")
    check_finite(f"{path}.weight", quota.weight, low=0, high=MAX_QUOTA_WEIGHT)
    for name in ("guaranteed_gpus", "borrow_limit"):
        if not 0 <= getattr(quota, name) <= 2**31 - 1:
            raise errors.ValidationError(f"{path}.{name}", "must be between 0 and 2147483647")
