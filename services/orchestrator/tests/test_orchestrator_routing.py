"""Routing: a job's typed hints (the workflow waiting on it, whether it gets the automatic
eval), with the old labels read where the typed fields are unset."""

from __future__ import annotations

from forge.common.v1 import common_pb2

from forge_orchestrator.routing import AUTO_EVAL_LABEL, WORKFLOW_ID_LABEL, Routing


def test_routing_round_trips_and_reads_the_old_labels_where_unset() -> None:
    hints = Routing("wf-1", auto_eval=False)
    assert Routing.read(hints.to_proto(), {}) == hints
    assert Routing.read(None, {WORKFLOW_ID_LABEL: "wf-2", AUTO_EVAL_LABEL: "FALSE"}) == Routing("wf-2", False)
    assert Routing.read(None, {}) == Routing("", True)
    # typed fields win over labels; either one saying "skip" skips
    typed = common_pb2.JobRouting(workflow_id="wf-3")
    assert Routing.read(typed, {WORKFLOW_ID_LABEL: "old"}) == Routing("wf-3", True)
    assert Routing.read(typed, {AUTO_EVAL_LABEL: "false"}).auto_eval is False
