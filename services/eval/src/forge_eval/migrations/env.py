"""Alembic environment of the eval database."""

from forge_kit import events  # noqa: F401 - registers the outbox tables on Base.metadata
from forge_kit.db import Base, run_alembic_env
from forge_eval.store import registry, runs  # noqa: F401 - registers the eval tables

run_alembic_env(Base.metadata)
