"""Tenants, model aliases and the kit tables.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

from forge_kit.migration_ops import create_kit_tables, drop_kit_tables

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("name", sa.String(63), nullable=False, unique=True),
        sa.Column("key_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("priority_class", sa.String(32), nullable=False),
        sa.Column("rpm_limit", sa.Integer, nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
    )
    op.create_table(
        "model_aliases",
        sa.Column("alias", sa.String(255), primary_key=True),
        sa.Column("model_name", sa.String(255), nullable=False),
        sa.Column("model_version", sa.String(255), nullable=False),
        sa.Column("stage", sa.String(63), nullable=False),
        sa.Column("source_event_id", sa.String(64), nullable=False),
        sa.Column("updated_at", sa.DateTime, nullable=False),
    )
    create_kit_tables()


def downgrade() -> None:
    drop_kit_tables()
    op.drop_table("model_aliases")
    op.drop_table("tenants")
