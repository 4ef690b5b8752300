"""Alembic environment of the inference gateway database."""

from forge_kit import events  # noqa: F401 - registers the outbox and processed-event tables on Base.metadata
from forge_kit.db import Base, run_alembic_env
from forge_inference_gateway import store  # noqa: F401 - registers the gateway tables
from forge_inference_gateway.keys import rows as key_rows  # noqa: F401 - registers the key tables
from forge_inference_gateway.vector_stores import rows  # noqa: F401 - registers the document tables

run_alembic_env(Base.metadata)
