"""JobState: one enum from the wire number to the names workflows use; Routing: typed hints with
the old labels read where the typed fields are unset."""

from __future__ import annotations

import json

import pytest
from forge.common.v1 import common_pb2

from forge_kit.jobstate import JobState
from forge_kit.routing import AUTO_EVAL_LABEL, WORKFLOW_ID_LABEL, Routing


def test_every_proto_state_has_its_member_and_back() -> None:
    for name, number in common_pb2.JobState.items():
        state = JobState.from_proto(number)
        assert state.proto == number and f"JOB_STATE_{state.value}" == name
    assert JobState.from_proto(common_pb2.JOB_STATE_CANCELLED) == "CANCELLED"
    assert json.dumps([JobState.SUCCEEDED]) == '["SUCCEEDED"]'  # what workflow histories hold
    assert [s for s in JobState if s.terminal] == [JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED]


def test_an_unknown_state_number_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown number 99"):
        JobState.from_proto(99)


def test_routing_round_trips_and_reads_the_old_labels_where_unset() -> None:
    hints = Routing("wf-1", auto_eval=False)
    assert Routing.read(hints.to_proto(), {}) == hints
    assert Routing.read(None, {WORKFLOW_ID_LABEL: "wf-2", AUTO_EVAL_LABEL: "FALSE"}) == Routing("wf-2", False)
    assert Routing.read(None, {}) == Routing("", True)
    # typed fields win over labels; either one saying "skip" skips
    typed = common_pb2.JobRouting(workflow_id="wf-3")
    assert Routing.read(typed, {WORKFLOW_ID_LABEL: "old"}) == Routing("wf-3", True)
    assert Routing.read(typed, {AUTO_EVAL_LABEL: "false"}).auto_eval is False
