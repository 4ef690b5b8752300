"""Models, stage history, runs, metrics, per-example results and the kit tables.

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
        "eval_models",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("version", sa.String(64), nullable=False),
        sa.Column("uri", sa.Text, nullable=False),
        sa.Column("labels", sa.JSON, nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.UniqueConstraint("name", "version", name="uq_eval_models_name_version"),
    )
    op.create_index("ix_eval_models_name", "eval_models", ["name"])
    op.create_table(
        "eval_stage_events",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("stage", sa.String(64), nullable=False),
        sa.Column("action", sa.String(16), nullable=False),
        sa.Column("model_id", sa.Integer, sa.ForeignKey("eval_models.id"), nullable=False),
        sa.Column("previous_model_id", sa.Integer, sa.ForeignKey("eval_models.id"), nullable=True),
        sa.Column("traffic_percent", sa.Integer, nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("gate_run_id", sa.String(40), nullable=False),
        sa.Column("rolled_back", sa.Boolean, nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
    )
    op.create_index("ix_eval_stage_events_stage", "eval_stage_events", ["stage"])
    op.create_table(
        "eval_runs",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("suite", sa.String(64), nullable=False),
        sa.Column("model_name", sa.String(128), nullable=False),
        sa.Column("model_version", sa.String(64), nullable=False),
        sa.Column("endpoint", sa.Text, nullable=False),
        sa.Column("spec", sa.JSON, nullable=False),
        sa.Column("spec_hash", sa.String(64), nullable=False),
        sa.Column("status", sa.Integer, nullable=False),
        sa.Column("error", sa.Text, nullable=False),
        sa.Column("example_count", sa.Integer, nullable=False),
        sa.Column("passed_gate", sa.Boolean, nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.Column("started_at", sa.DateTime, nullable=True),
        sa.Column("finished_at", sa.DateTime, nullable=True),
    )
    op.create_index("ix_eval_runs_suite", "eval_runs", ["suite"])
    op.create_index("ix_eval_runs_model_name", "eval_runs", ["model_name"])
    op.create_index("ix_eval_runs_spec_hash", "eval_runs", ["spec_hash"])
    op.create_index("ix_eval_runs_status", "eval_runs", ["status"])
    op.create_index("ix_eval_runs_created_at", "eval_runs", ["created_at"])
    op.create_table(
        "eval_run_metrics",
        sa.Column(
            "run_id", sa.String(40), sa.ForeignKey("eval_runs.id", ondelete="CASCADE"), primary_key=True
        ),
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("value", sa.Float, nullable=False),
        sa.Column("ci_low", sa.Float, nullable=False),
        sa.Column("ci_high", sa.Float, nullable=False),
        sa.Column("n", sa.Integer, nullable=False),
    )
    op.create_table(
        "eval_run_examples",
        sa.Column(
            "run_id", sa.String(40), sa.ForeignKey("eval_runs.id", ondelete="CASCADE"), primary_key=True
        ),
        sa.Column("example_id", sa.String(128), primary_key=True),
        sa.Column("metric", sa.String(64), primary_key=True),
        sa.Column("score", sa.Float, nullable=False),
        sa.Column("prompt", sa.Text, nullable=False),
        sa.Column("output", sa.Text, nullable=False),
        sa.Column("extracted", sa.Text, nullable=False),
        sa.Column("target", sa.Text, nullable=False),
    )
    create_kit_tables()


def downgrade() -> None:
    drop_kit_tables()
    op.drop_table("eval_run_examples")
    op.drop_table("eval_run_metrics")
    op.drop_table("eval_runs")
    op.drop_table("eval_stage_events")
    op.drop_table("eval_models")
