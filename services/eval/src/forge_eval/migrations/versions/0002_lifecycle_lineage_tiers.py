"""Model lifecycle stage and lineage; audited stage events (actor, forced, gate report); run tier,
served runs and report paths.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("eval_models") as batch:
        batch.add_column(sa.Column("stage", sa.String(16), nullable=False, server_default="candidate"))
        batch.add_column(sa.Column("training_run_id", sa.String(128), nullable=False, server_default=""))
        batch.add_column(sa.Column("recipe_hash", sa.String(128), nullable=False, server_default=""))
        batch.add_column(sa.Column("data_hash", sa.String(128), nullable=False, server_default=""))
        batch.add_column(
            sa.Column(
                "parent_model_id",
                sa.Integer,
                sa.ForeignKey("eval_models.id", name="fk_eval_models_parent"),
                nullable=True,
            )
        )
        batch.create_index("ix_eval_models_training_run_id", ["training_run_id"])
    with op.batch_alter_table("eval_stage_events") as batch:
        batch.add_column(sa.Column("from_stage", sa.String(16), nullable=False, server_default=""))
        batch.add_column(sa.Column("actor", sa.String(128), nullable=False, server_default=""))
        batch.add_column(sa.Column("forced", sa.Boolean, nullable=False, server_default=sa.false()))
        batch.add_column(sa.Column("gate_report", sa.Text, nullable=False, server_default=""))
    with op.batch_alter_table("eval_runs") as batch:
        batch.add_column(sa.Column("tier", sa.String(16), nullable=False, server_default="full"))
        batch.add_column(sa.Column("serve_model", sa.Boolean, nullable=False, server_default=sa.false()))
        batch.add_column(sa.Column("report_path", sa.Text, nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("eval_runs") as batch:
        batch.drop_column("report_path")
        batch.drop_column("serve_model")
        batch.drop_column("tier")
    with op.batch_alter_table("eval_stage_events") as batch:
        batch.drop_column("gate_report")
        batch.drop_column("forced")
        batch.drop_column("actor")
        batch.drop_column("from_stage")
    with op.batch_alter_table("eval_models") as batch:
        batch.drop_index("ix_eval_models_training_run_id")
        batch.drop_column("parent_model_id")
        batch.drop_column("data_hash")
        batch.drop_column("recipe_hash")
        batch.drop_column("training_run_id")
        batch.drop_column("stage")
