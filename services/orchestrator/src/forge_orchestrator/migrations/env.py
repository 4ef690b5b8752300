"""Alembic environment of the orchestrator database."""

from forge_kit import eventlog, events  # noqa: F401 - registers the kit tables on Base.metadata
from forge_kit.db import Base, run_alembic_env
from forge_orchestrator import store  # noqa: F401 - registers the orchestrator tables

run_alembic_env(Base.metadata)
