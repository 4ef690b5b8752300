"""The main job's ``sweep`` step: its space passes every check the orchestrator makes before a job
exists, is small enough for ``forge up`` and has rungs to stop trials at; its table rows."""

from __future__ import annotations

from forge_experiments import sweepspace
from forge_orchestrator.main_job.rlhf import TEAM as TRAIN_TEAM
from forge_orchestrator.main_job.rlhf import rlhf
from forge_orchestrator.main_job.sweep import SPACE, TEAM, _trial_row, sweep
from forge_orchestrator.sweep.service import validate_sweep
from forge_orchestrator.sweep.workflow import SweepInput


def test_the_space_passes_the_api_checks_and_has_rungs_to_stop_trials_at() -> None:
    space = sweepspace.parse(SPACE)
    validate_sweep(SweepInput(space=SPACE, team=TEAM))  # what the orchestrator checks
    assert space.recipe == "shakespeare_tiny" and space.early_stopping.rule == "asha"
    assert space.early_stopping.form == "promotion" and space.rungs() == [5, 15]
    assert len(space.configurations()) == 6 and space.max_steps * 6 <= 300
    # Last: the automatic eval-and-promote of the train step's checkpoint watches its canary while
    # the eval step drives traffic; a sweep in between would let that window pass unwatched.
    assert sweep.order > rlhf.order  # type: ignore[attr-defined]


def test_trial_rows_say_where_a_trial_stopped_or_how_it_ended() -> None:
    stopped = {"params": {"optim.lr": 0.016, "model.hidden_size": 64}, "state": "stopped", "stopped_at": 5}
    done = {"params": {"optim.lr": 0.004}, "state": "completed", "final": 4.12345}
    assert _trial_row(stopped) == "hidden_size=64, lr=0.016: stopped at step 5"
    assert _trial_row(done) == "lr=0.004: completed, val_loss 4.123"


def test_the_sweep_runs_as_the_train_steps_team_whose_quota_covers_the_agents_gpus() -> None:
    # A team without a quota (guarantee 0, borrowing 0) would leave every trial queued.
    assert TEAM == TRAIN_TEAM
    assert sweepspace.parse(SPACE).team == TEAM
