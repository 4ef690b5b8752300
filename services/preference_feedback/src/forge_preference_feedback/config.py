"""Preference feedback settings (env prefix ``FORGE_PREFERENCE_FEEDBACK_``)."""

from __future__ import annotations

from pydantic import Field, SecretStr

from forge_kit.settings import ServiceSettings, service_config


class FeedbackSettings(ServiceSettings):
    """Settings of the preference feedback process."""

    model_config = service_config("preference_feedback")

    grpc_port: int = Field(default=50058, ge=0, le=65535)
    """gRPC port of the PreferenceFeedbackService."""

    http_port: int = Field(default=8058, ge=0, le=65535)
    """HTTP port for health, metrics and the rater web UI (``/ui``)."""

    inference_gateway_url: str = "http://127.0.0.1:8080"
    """Gateway base URL, for drawing fresh response pairs (not called yet: comparisons come from seeds)."""

    inference_gateway_token: SecretStr = SecretStr("")
    """Bearer token for the gateway."""

    seed_dir: str = ""
    """HH-RLHF folder (``<subset>/*.jsonl.gz``) to seed comparisons from at start-up; empty: no seeding."""

    seed_limit: int = Field(default=200, ge=1)
    """How many comparisons a start-up seed loads (already-seeded pairs count and are skipped)."""

    seed_rng_seed: int = 0
    """Seed of the per-comparison A/B order randomisation."""

    assignment_lease_s: float = Field(default=600.0, gt=0)
    """How long a comparison handed to a rater is reserved for them before others may get it."""

    max_page_size: int = Field(default=500, ge=1)
    """Upper bound on page_size in list calls."""

    overlap_k: int = Field(default=3, ge=1)
    """Raters per comparison: an item is handed out until this many have answered or hold it."""

    session_ttl_s: int = Field(default=12 * 3600, ge=60)
    """How long a rater's login lasts."""

    group_commit: bool = True
    """SQLite: commit the rating hot path's units in groups on one writer thread (one transaction,
    a savepoint each); false runs each unit as its own transaction on the async engine (slower;
    for comparison and diagnosis). PostgreSQL always runs a concurrent transaction per unit, which
    measured faster there than group commit (``transactions.AsyncTransactions``)."""

    session_cache_s: float = Field(default=5.0, ge=0)
    """How long a checked session is remembered in-process (0: check the database on every call);
    a logout in another replica takes effect within this time."""

    secure_cookies: bool = False
    """Mark session cookies ``Secure`` (HTTPS only); set it wherever the UI is served over TLS."""

    admin_password: SecretStr = SecretStr("")
    """When set, the account ``admin`` (an admin) is created at start-up with this password if missing."""

    quality_min_median_seconds: float = Field(default=3.0, ge=0)
    """Raters whose median time per item is below this are flagged as too fast."""

    snapshot_dir: str = ""
    """Folder of training snapshots written by ExportSnapshot (``<snapshot id>/``); empty:
    ``<data_dir>/snapshots``. Trainer jobs read the snapshots from here, so it must be shared."""

    default_heldout_fraction: float = Field(default=0.1, ge=0.0, lt=1.0)
    """Share of comparisons an ExportSnapshot holds out when the request does not say."""
