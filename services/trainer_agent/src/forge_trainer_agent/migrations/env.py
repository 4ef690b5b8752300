"""Alembic environment of the trainer agent database."""

from forge_kit import events  # noqa: F401 - registers the outbox tables on Base.metadata
from forge_kit.db import Base, run_alembic_env
from forge_trainer_agent import store  # noqa: F401 - registers the agent's tables

run_alembic_env(Base.metadata)
