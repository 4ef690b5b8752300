"""The kit's typed job commands run the training library's programs: each built command is started
as a real process, and what it answers shows its module and every flag were understood."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from forge_experiments.jobcmd import (
    JobCommandError,
    PolicyCheckCommand,
    RewardModelEvalCommand,
    TrainCommand,
    render_value,
)


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)


def test_a_train_command_reaches_the_recipe_parser_with_its_overrides() -> None:
    command = TrainCommand("smoke", ("optim.lr=0.01", "no_such.key=1"), python=sys.executable)
    done = _run(command.argv())
    # Exit 2 with the recipe's own refusal (not argparse's usage line): module, --recipe and both
    # --set reached forge_training.run, and the unknown key is named.
    assert done.returncode == 2, done.stderr
    assert "recipe refused" in done.stderr and "no_such.key" in done.stderr
    assert "usage:" not in done.stderr


def test_typed_values_are_rendered_as_the_recipe_parser_reads_them() -> None:
    command = TrainCommand.with_values("smoke", {"optim.lr": 0.1 + 0.2, "data.shuffle": True, "max_steps": 3})
    assert command.overrides == ("optim.lr=0.30000000000000004", "data.shuffle=true", "max_steps=3")
    assert command.argv()[:5] == ["python", "-m", "forge_training.run", "--recipe", "smoke"]
    assert render_value(False) == "false" and render_value(2.5) == "2.5"


def test_a_policy_check_command_reaches_the_program_with_every_flag(tmp_path: Path) -> None:
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("{not json\n")
    command = PolicyCheckCommand(
        reference=str(tmp_path / "ref"),
        reward_model=str(tmp_path / "rm"),
        pairs=str(pairs),
        out=str(tmp_path / "out"),
        policies=[str(tmp_path / "p1"), str(tmp_path / "p2")],
        max_prompts=4,
        max_new_tokens=8,
        seed=3,
        python=sys.executable,
    )
    argv = command.argv()
    assert argv.count("--policy") == 2
    done = _run(argv)
    # The pairs file is read first; its error is the program's own (exit 2, named), not argparse's.
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("policy_check:") and "usage:" not in done.stderr
    assert not (tmp_path / "out" / "summary.json").exists()


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: TrainCommand(""), "recipe"),
        (lambda: TrainCommand("--help"), "recipe"),
        (lambda: TrainCommand("smoke", ("optim.lr",)), "overrides"),
        (lambda: TrainCommand("smoke", ("--x=1",)), "overrides"),
        (lambda: TrainCommand("smoke", python=""), "python"),
        (lambda: PolicyCheckCommand("r", "m", "p", "o", policies=[]), "policies"),
        (lambda: PolicyCheckCommand("r", "m", "p", "o", policies=[""]), "policies"),
        (lambda: PolicyCheckCommand("", "m", "p", "o", policies=["x"]), "reference"),
        (lambda: PolicyCheckCommand("r", "m", "p", "o", policies=["x"], max_prompts=0), "max_prompts"),
    ],
)
def test_bad_commands_are_refused_naming_the_field(build: object, field: str) -> None:
    with pytest.raises(JobCommandError, match=field):
        build()  # type: ignore[operator]


def test_a_reward_model_eval_command_reaches_the_scorer_with_every_flag(tmp_path: Path) -> None:
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("{not json\n")
    command = RewardModelEvalCommand(
        checkpoint=str(tmp_path / "rm"), pairs=str(pairs), out=str(tmp_path / "out"), python=sys.executable
    )
    done = _run(command.argv())
    # The checkpoint folder does not exist: the scorer's own error (exit 2, named), not argparse's.
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("rm_score:") and "usage:" not in done.stderr
    assert not (tmp_path / "out" / "summary.json").exists()
    with pytest.raises(JobCommandError, match="checkpoint"):
        RewardModelEvalCommand(checkpoint="", pairs="p", out="o")
