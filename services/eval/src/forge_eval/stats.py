"""Statistics of eval runs: the platform's one copy lives in :mod:`forge_kit.stats` (sweep reports
use it too); this module keeps the eval service's import path."""

from forge_kit.stats import (
    CONFIDENCE,
    Estimate,
    PairedResult,
    mcnemar_exact,
    mean_estimate,
    paired_compare,
    sign_flip_p,
    standard_error,
)

__all__ = [
    "CONFIDENCE",
    "Estimate",
    "PairedResult",
    "mcnemar_exact",
    "mean_estimate",
    "paired_compare",
    "sign_flip_p",
    "standard_error",
]
