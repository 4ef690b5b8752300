"""JobState: one enum from the wire number to the names workflows use."""

from __future__ import annotations

import json

import pytest
from forge.common.v1 import common_pb2

from forge_kit.jobstate import JobState


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
