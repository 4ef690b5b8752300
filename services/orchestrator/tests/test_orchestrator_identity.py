"""What a workflow's caller may ask for (``identity.authorize_start``)."""

from __future__ import annotations

import pytest

from forge_kit import errors
from forge_kit.grpckit import Principal
from forge_orchestrator.identity import ADMIN, Caller, authorize_start, caller_of, validate_python
from forge_orchestrator.rlhf.workflow import RlhfInput
from forge_orchestrator.training.model import TrainInput

TEAM_A = Caller(name="team:a", role="team", team="a")


def test_principals_become_callers() -> None:
    assert caller_of(None) == ADMIN and ADMIN.is_admin and ADMIN.on_behalf_of == ""
    team = caller_of(Principal(name="team:a", role="team", team="a"))
    assert team == TEAM_A and not team.is_admin and team.on_behalf_of == "a"
    assert caller_of(Principal(name="eval-user", role="user")).role == "team"  # not an admin


@pytest.mark.parametrize("good", ["python", "python3.11", "/usr/bin/python3", "/work/main/.venv/bin/python"])
def test_interpreters_that_mean_the_same_on_every_node(good: str) -> None:
    validate_python("input.python", good)


@pytest.mark.parametrize(
    "bad",
    [
        ".venv/bin/python",
        "bin/python",
        "./python",
        "/a/../bin/sh",
        "/a//b",
        "/a/./b",
        "/usr/bin/py\nthon",
        "",
    ],
)
def test_relative_or_unnormalised_interpreters_are_refused(bad: str) -> None:
    with pytest.raises(errors.ValidationError) as caught:
        validate_python("input.python", bad)
    assert caught.value.field == "input.python"


def test_a_team_starts_its_own_training_with_the_default_interpreter_only() -> None:
    authorize_start("training", TrainInput(team="a", recipe="r"), TEAM_A)
    for params in (TrainInput(team="b", recipe="r"), TrainInput(team="a", recipe="r", python="/bin/sh")):
        with pytest.raises(errors.PermissionDeniedError):
            authorize_start("training", params, TEAM_A)
    with pytest.raises(errors.PermissionDeniedError):
        authorize_start("rlhf", RlhfInput(policy_uri="/p", work_uri="/w", team="a"), TEAM_A)
    authorize_start("rlhf", RlhfInput(policy_uri="/p", work_uri="/w"), ADMIN)
    authorize_start("training", TrainInput(team="b", recipe="r", python="/opt/py/bin/python"), ADMIN)
    with pytest.raises(errors.ValidationError):
        authorize_start("training", TrainInput(team="b", recipe="r", python=".venv/bin/python"), ADMIN)
