"""``forge bench sweep`` end to end on a tiny space: both runs, the summary's figures consistent
with its per-trial rows, and a space the recipe refuses rejected before any training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from forge_kit.paths import resolve_data_path
from forge_training import schema
from forge_training.bench import app

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not resolve_data_path(schema.DEFAULT_CORPUS).is_file(), reason="needs the tinyshakespeare corpus"
    ),
]

SPACE = """
name: tiny
recipe: smoke
metric: {name: val_loss, mode: min}
sampler: grid
seed: 3
parameters:
  optim.lr: {type: categorical, values: [0.003, 0.001, 0.0005]}
overrides: {checkpoint.interval_steps: 0}
gpu_type: SIM
budget: {trials: 3, gpu_hours: 1, max_steps: 9}
concurrency: 2
early_stopping: {rule: asha, min_steps: 1, eta: 3}
"""


def test_grid_and_asha_over_one_space(tmp_path: Path) -> None:
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    result = CliRunner().invoke(app, ["sweep", "--space", str(space), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    rows = summary["per_trial"]
    grid = [r for r in rows if r["run"] == "grid"]
    asha = [r for r in rows if r["run"] == "asha"]
    assert summary["rungs"] == [1, 3] and len(grid) == len(asha) == 3 and summary["form"] == "promotion"
    assert summary["asha"]["concurrency"] == 2 and sum(summary["asha"]["rung_occupancy"].values()) >= 3
    assert summary["grid"]["trial_steps"] == 27 == sum(r["steps"] for r in grid)
    assert summary["asha"]["trial_steps"] == sum(r["steps"] for r in asha) < 27
    assert summary["asha"]["stopped_early"] == sum(r["stopped_at"] is not None for r in asha) >= 1
    assert summary["compute_ratio"] == summary["asha"]["trial_steps"] / summary["grid"]["trial_steps"]
    assert summary["grid"]["best_metric"] == min(r["final"] for r in grid)
    assert summary["regret"] == pytest.approx(summary["asha"]["best_metric"] - summary["grid"]["best_metric"])
    # A trial ASHA let finish ends where the same configuration ended in the grid (deterministic).
    finals = {r["trial"]: r["final"] for r in grid}
    assert all(r["final"] == finals[r["trial"]] for r in asha if r["final"] is not None)


def test_a_space_the_recipe_refuses_is_rejected_before_training(tmp_path: Path) -> None:
    space = tmp_path / "space.yaml"
    space.write_text(
        SPACE.replace("[0.003, 0.001, 0.0005]", "[0.003, 0.00001]").replace("trials: 3", "trials: 2")
    )
    result = CliRunner().invoke(app, ["sweep", "--space", str(space), "--out", str(tmp_path / "out")])
    assert result.exit_code != 0
    assert "min_lr" in result.output and not (tmp_path / "out" / "summary.json").exists()


def test_cooldown_rungs_grid_records_and_an_asha_only_run(tmp_path: Path) -> None:
    """Under ``rung_eval: cooldown`` every ASHA trial pays its branches (in its steps) and the rule
    records the branch values; a second run over the same ``--out`` reads the grid's records
    instead of training the grid again, and ends with the same figures."""
    space = tmp_path / "space.yaml"
    space.write_text(SPACE.replace("eta: 3}", "eta: 3, rung_eval: cooldown, cooldown_fraction: 0.5}"))
    out = tmp_path / "out"
    runs = []
    for extra in ([], [], ["--asha-only"]):
        result = CliRunner().invoke(
            app, ["sweep", "--space", str(space), "--out", str(out), "--quiet", *extra]
        )
        assert result.exit_code == 0, result.output
        runs.append(json.loads((out / "summary.json").read_text()))
    first, again, alone = runs
    assert first["rung_eval"] == "cooldown" and first["cooldown_fraction"] == 0.5
    asha = [r for r in first["per_trial"] if r["run"] == "asha"]
    # Rungs 1 and 3 of 9 steps: branches of ceil(0.5 x 1) = 1 and ceil(0.5 x 3) = 2 steps.
    assert all(r["branch_steps"] == sum({1: 1, 3: 2}[s] for s, _ in r["rung_values"]) for r in asha)
    assert all(r["rung_values"] and r["steps"] >= r["branch_steps"] + 2 for r in asha)
    assert first["asha"]["branch_steps"] == sum(r["branch_steps"] for r in asha) >= 3
    assert first["asha"]["trial_steps"] == sum(r["steps"] for r in asha)
    grid = [r for r in first["per_trial"] if r["run"] == "grid"]
    assert all(r["branch_steps"] == 0 and r["rung_values"] == [] for r in grid)  # no branches in the grid
    assert first["grid"]["reused"] == 0 and again["grid"]["reused"] == 3
    same = ("best_metric", "trial_steps")
    assert {k: again["grid"][k] for k in same} == {k: first["grid"][k] for k in same}
    assert (again["compute_ratio"], again["regret"]) == (first["compute_ratio"], first["regret"])
    assert alone["grid"] == {"skipped": True, "trial_steps": 27} and alone["regret"] is None
    assert alone["asha"]["trial_steps"] == first["asha"]["trial_steps"]


def test_several_spaces_worst_figures_and_the_default_rule(tmp_path: Path) -> None:
    """Two spaces in one run: each one's summary under ``spaces/<name>``, the worst regret and
    compute ratio over them; the second names no early-stopping setting (the budgeted rule, rungs
    1 and 3 of 9) and reads the grid records the first wrote (same trials, same cadence)."""
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text(SPACE)
    second.write_text(
        SPACE.replace("name: tiny", "name: tiny-default").replace(
            "early_stopping: {rule: asha, min_steps: 1, eta: 3}", "early_stopping: {}"
        )
    )
    out = tmp_path / "out"
    args = ["sweep", "--space", str(first), "--space", str(second), "--out", str(out), "--quiet"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    spaces = summary["spaces"]
    assert sorted(spaces) == ["tiny", "tiny-default"] and "per_trial" not in spaces["tiny"]
    assert spaces["tiny"]["rule"] == "asha" and spaces["tiny-default"]["rule"] == "budgeted"
    assert spaces["tiny-default"]["rungs"] == [1, 3] and spaces["tiny-default"]["grid"]["reused"] == 3
    worst = summary["worst"]
    assert worst["regret"] == max(s["regret"] for s in spaces.values())
    assert worst["compute_ratio"] == max(s["compute_ratio"] for s in spaces.values())
    assert spaces[worst["compute_ratio_space"]]["compute_ratio"] == worst["compute_ratio"]
    for name, brief in spaces.items():
        full = json.loads((out / "spaces" / name / "summary.json").read_text())
        assert full["per_trial"] and full["compute_ratio"] == brief["compute_ratio"]
        trust = brief["trust"]
        finished = sum(r["final"] is not None for r in full["per_trial"] if r["run"] == "asha")
        assert set(trust["rungs"]) == {str(r) for r in brief["rungs"]}
        assert all(row["finished"] == finished for row in trust["rungs"].values())
        assert trust["stopped"] == brief["asha"]["stopped_early"]
        assert 0 <= trust["stopped_within_noise"] <= trust["stopped"]


def test_drawn_spaces_are_seeded_valid_and_refused_without_a_seed(tmp_path: Path) -> None:
    from forge_experiments.sweepspace import from_dict
    from forge_training.bench.sweep_cli import random_spaces

    drawn = random_spaces(10, 1)
    assert drawn == random_spaces(10, 1) and drawn != random_spaces(10, 2)
    spaces = [from_dict(d) for d in drawn]
    assert len({s.name for s in spaces}) == 10
    for space in spaces:
        assert len(space.configurations()) == 12 and space.max_steps == 243
        assert space.early_stopping.rule == "budgeted" and space.rungs() == [9, 27, 81]
        assert space.parameters[0].key == "optim.lr" and space.overrides["optim.schedule"] in (
            "cosine",
            "wsd",
        )
    runner = CliRunner()
    refused = runner.invoke(app, ["sweep", "--random-spaces", "3", "--out", str(tmp_path / "o")])
    assert refused.exit_code != 0 and "--seed" in refused.output
    space = tmp_path / "a.yaml"
    space.write_text(SPACE)
    twice = runner.invoke(
        app, ["sweep", "--space", str(space), "--space", str(space), "--out", str(tmp_path / "o")]
    )
    assert twice.exit_code != 0 and "share a name" in twice.output
    many = runner.invoke(app, ["sweep", "--random-spaces", "65", "--seed", "1", "--out", str(tmp_path / "o")])
    assert many.exit_code != 0 and "at most 64" in many.output
    assert not (tmp_path / "o" / "summary.json").exists()
