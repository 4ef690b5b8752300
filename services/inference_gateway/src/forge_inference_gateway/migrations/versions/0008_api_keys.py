"""Several API keys per tenant, with scopes, expiry, revocation and usage, and their audit log.

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("tenant_id", sa.String(40), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("name", sa.String(63), nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("scopes", sa.String(255), nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.Column("expires_at", sa.DateTime, nullable=True),
        sa.Column("revoked_at", sa.DateTime, nullable=True),
        sa.Column("last_used_at", sa.DateTime, nullable=True),
        sa.Column("rotated_from", sa.String(40), nullable=False),
        sa.Column("requests", sa.BigInteger, nullable=False),
        sa.Column("tokens", sa.BigInteger, nullable=False),
        sa.Column("documents", sa.BigInteger, nullable=False),
    )
    op.create_index("ix_api_keys_tenant_id", "api_keys", ["tenant_id"])
    op.create_table(
        "api_key_audit",
        sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("tenant_id", sa.String(40), nullable=False),
        sa.Column("key_id", sa.String(40), nullable=False),
        sa.Column("action", sa.String(32), nullable=False),
        sa.Column("actor", sa.String(63), nullable=False),
        sa.Column("detail", sa.Text, nullable=False),
        sa.Column("at", sa.DateTime, nullable=False),
    )
    op.create_index("ix_api_key_audit_tenant_id", "api_key_audit", ["tenant_id"])


def downgrade() -> None:
    op.drop_index("ix_api_key_audit_tenant_id", "api_key_audit")
    op.drop_table("api_key_audit")
    op.drop_index("ix_api_keys_tenant_id", "api_keys")
    op.drop_table("api_keys")
