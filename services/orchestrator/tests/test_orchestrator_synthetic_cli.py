"""``forge workflows start synthetic`` against a real orchestrator process (real scheduler, broker
and Temporal): a bad input is refused naming the field before anything runs; a good one starts
the workflow on the synthetic worker of that process. Its teacher (the default address: nothing
listens there on a test machine) never answers, so the run's calls are retried and counted and it
ends ``no_problems`` — completed, not crashed — with the counts in its result."""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

from forge_orchestrator.cli import app as cli_app

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

GOOD = {
    "team": "synthetic-cli",
    "work_uri": "",
    "student_uri": "/nonexistent/student",
    "student_model": "student",
    "templates": ["add_sub"],
    "heldout_templates": ["bus_stop"],
    "problems": 2,
    "teacher_url": "http://127.0.0.1:9/v1",
    "teacher_attempts": 2,
    "teacher_timeout_s": 2.0,
}


@pytest.mark.parametrize(
    ("change", "field", "says"),
    [
        ({"band_low": 0.9, "band_high": 0.1}, "input.band_low", "band_low <= band_high"),
        (
            {"templates": ["add_sub"], "heldout_templates": ["add_sub"]},
            "input.heldout_templates",
            "must not share",
        ),
        ({"policy": "vote"}, "input.policy", "majority, drop"),
        ({"problems": 0}, "input.problems", "between 1 and 100000"),
        ({"sft_overrides": ["pairs.path=/etc"]}, "input.sft_overrides[0]", "set by the workflow"),
        ({"teacher_url": "file:///etc/passwd"}, "input.teacher_url", "http(s) URL"),
        ({"samples": "8"}, "input.samples", "must be an integer"),
        ({"colour": "red"}, "input.colour", "is not a field of SyntheticInput"),
    ],
)
def test_a_bad_input_is_refused_naming_the_field(
    shared_orchestrator: Any, tmp_path: Any, change: dict[str, Any], field: str, says: str
) -> None:
    env = {
        "FORGE_CLI_ORCHESTRATOR_TARGET": shared_orchestrator.target,
        "FORGE_CLI_ORCHESTRATOR_TOKEN": shared_orchestrator.token,
    }
    data = {**GOOD, "work_uri": str(tmp_path), **change}
    bad = CliRunner().invoke(cli_app, ["start", "synthetic", "--input", json.dumps(data)], env=env)
    assert bad.exit_code == 1 and "INVALID_ARGUMENT" in bad.output, bad.output
    assert field in bad.output and says in bad.output, bad.output


def test_start_runs_the_workflow_and_an_unreachable_teacher_ends_it_cleanly(
    shared_orchestrator: Any, tmp_path: Any
) -> None:
    env = {
        "FORGE_CLI_ORCHESTRATOR_TARGET": shared_orchestrator.target,
        "FORGE_CLI_ORCHESTRATOR_TOKEN": shared_orchestrator.token,
    }
    data = {**GOOD, "work_uri": str(tmp_path)}
    started = CliRunner().invoke(
        cli_app,
        ["start", "synthetic", "--input", json.dumps(data), "--wait", "--timeout", "90", "--json"],
        env=env,
    )
    assert started.exit_code == 0, started.output
    view = json.loads(started.output)
    assert view["workflow_type"] == "synthetic" and view["status"] == "COMPLETED"
    result = view["result"]
    assert result["outcome"] == "no_problems" and "the teacher gave no usable problem" in result["message"]
    teacher = result["teacher"]
    assert teacher["server_errors"] == 2 and teacher["retries"] == 1 and teacher["failed_calls"] == 1
    assert (
        json.loads((tmp_path / view["workflow_id"] / "summary.json").read_text())["outcome"] == "no_problems"
    )
