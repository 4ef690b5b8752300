"""Sweep spaces: what a valid file names, and every refusal naming its field."""

from __future__ import annotations

import pytest

from forge_experiments import sweepspace
from forge_kit.errors import ValidationError

BASE = """
name: s
recipe: shakespeare_tiny
metric: {name: val_loss, mode: min}
sampler: grid
parameters:
  optim.lr: {type: loguniform, low: 1.0e-3, high: 1.0e-1, grid_points: 3}
  optim.warmup_steps: {type: int, low: 0, high: 20, step: 10}
  model.hidden_size: {type: categorical, values: [64, 128]}
seeds: [1, 2]
baseline: {optim.lr: 0.01, optim.warmup_steps: 10, model.hidden_size: 64}
gpu_type: SIM
budget: {trials: 36, gpu_hours: 2, max_steps: 81}
early_stopping: {rule: asha, min_steps: 3, eta: 3}
"""


def test_grid_rungs_and_trial_overrides() -> None:
    space = sweepspace.parse(BASE)
    grid = space.grid()
    assert len(grid) == 18
    assert sorted({c["optim.lr"] for c in grid}) == [0.001, 0.01, 0.1]  # evenly spaced in log
    assert sorted({c["optim.warmup_steps"] for c in grid}) == [0, 10, 20]
    assert space.rungs() == [3, 9, 27]
    overrides = space.trial_overrides(grid[0], seed=2)
    assert overrides["max_steps"] == 81 and overrides["eval_interval"] == 3 and overrides["seed"] == 2
    assert sweepspace.from_dict(sweepspace.to_dict(space)) == space


def test_random_configurations_are_seeded_and_in_range() -> None:
    text = BASE.replace("sampler: grid", "sampler: random").replace(
        "baseline: {optim.lr: 0.01, optim.warmup_steps: 10, model.hidden_size: 64}\n", ""
    )
    first, again = sweepspace.parse(text).configurations(), sweepspace.parse(text).configurations()
    assert first == again and len(first) == 18  # 36 trials / 2 seeds
    assert all(1e-3 <= float(c["optim.lr"]) <= 1e-1 and c["optim.warmup_steps"] in (0, 10, 20) for c in first)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (("optim.lr:", "optim.lrate:"), "parameters.optim.lrate"),
        (
            (
                "optim.warmup_steps: {type: int, low: 0, high: 20",
                "optim.warmup_steps: {type: int, low: 20, high: 20",
            ),
            "parameters.optim.warmup_steps.high",
        ),
        (("values: [64, 128]", "values: []"), "parameters.model.hidden_size.values"),
        (("low: 1.0e-3", "low: 0"), "parameters.optim.lr.low"),
        (("trials: 36", "trials: 0"), "budget.trials"),
        (("trials: 36", "trials: 35"), "budget.trials"),
        (("gpu_hours: 2", "gpu_hours: 0"), "budget.gpu_hours"),
        (("max_steps: 81", "max_steps: 0"), "budget.max_steps"),
        (("name: val_loss", "name: accuracy"), "metric.name"),
        (("recipe: shakespeare_tiny", "recipe: nope"), "recipe"),
        (("min_steps: 3", "min_steps: 81"), "early_stopping.min_steps"),
        (("eta: 3", "eta: 1"), "early_stopping.eta"),
        (("model.hidden_size: 64}", "model.hidden_size: 96}"), "baseline"),
        (("seeds: [1, 2]", "seeds: [1, 1]"), "seeds"),
        (("sampler: grid", "sampler: bayes"), "sampler"),
        (("optim.lr: {type: loguniform", "seed: {type: loguniform"), "parameters.seed"),
        (
            ("trials: 36, gpu_hours: 2, max_steps: 81", "trials: 2000, gpu_hours: 2, max_steps: 8100"),
            "budget.trials",
        ),
        (("eta: 3}", "eta: 3, rung_eval: anneal}"), "early_stopping.rung_eval"),
        (
            ("eta: 3}", "eta: 3, rung_eval: cooldown, cooldown_fraction: 0}"),
            "early_stopping.cooldown_fraction",
        ),
        (
            ("eta: 3}", "eta: 3, rung_eval: cooldown, cooldown_fraction: 1.5}"),
            "early_stopping.cooldown_fraction",
        ),
        (
            ("eta: 3}", "eta: 3, rung_eval: value, cooldown_fraction: 0.2}"),
            "early_stopping.cooldown_fraction",
        ),
        (
            ("rule: asha, min_steps: 3, eta: 3}", "rule: median, min_steps: 3, rung_eval: cooldown}"),
            "early_stopping.rung_eval",
        ),
        (("name: val_loss", "name: loss"), None),  # with rung_eval: cooldown below
    ],
)
def test_bad_spaces_are_refused_naming_the_field(change: tuple[str, str], field: str | None) -> None:
    text = BASE.replace(*change)
    if field is None:  # a training figure: fine to follow, but no cooldown branch reports it
        sweepspace.parse(text)
        text, field = text.replace("eta: 3}", "eta: 3, rung_eval: cooldown}"), "early_stopping.rung_eval"
    with pytest.raises(ValidationError) as caught:
        sweepspace.parse(text)
    assert caught.value.field == field, caught.value


def test_cooldown_rung_evaluations_become_the_trials_branch_keys() -> None:
    space = sweepspace.parse(BASE.replace("eta: 3}", "eta: 3, rung_eval: cooldown, cooldown_fraction: 0.15}"))
    es = space.early_stopping
    assert (es.rung_eval, es.cooldown_fraction) == ("cooldown", 0.15)
    overrides = space.trial_overrides(space.grid()[0], seed=1)
    assert overrides["rung_cooldown.fraction"] == 0.15 and overrides["rung_cooldown.min_steps"] == 3
    assert overrides["rung_cooldown.eta"] == 3 and overrides["eval_interval"] == 3
    # A trial no rung judges (the benchmark's grid) takes no branches.
    assert not any(
        k.startswith("rung_cooldown.") for k in space.trial_overrides(space.grid()[0], branches=False)
    )
    assert sweepspace.from_dict(sweepspace.to_dict(space)) == space
    plain = sweepspace.parse(BASE)
    assert plain.early_stopping.rung_eval == "value"
    assert not any(k.startswith("rung_cooldown.") for k in plain.trial_overrides(plain.grid()[0]))
    with pytest.raises(ValidationError) as caught:  # the rule sets the branch keys, not the space
        sweepspace.parse(
            BASE.replace("eta: 3}", "eta: 3, rung_eval: cooldown}").replace(
                "seeds: [1, 2]", "overrides: {rung_cooldown.fraction: 0.5}\nseeds: [1, 2]"
            )
        )
    assert caught.value.field == "overrides.rung_cooldown.fraction"


def test_hostile_input_is_refused() -> None:
    with pytest.raises(ValidationError, match="larger than"):
        sweepspace.parse("a" * (sweepspace.MAX_FILE_BYTES + 1))
    with pytest.raises(ValidationError, match="not valid YAML"):
        sweepspace.parse("name: [unclosed")
    with pytest.raises(ValidationError) as caught:
        sweepspace.parse(BASE + "extra: 1\n")
    assert caught.value.field == "extra"
    with pytest.raises(ValidationError) as caught:
        sweepspace.parse(BASE.replace("name: s\n", "name: ../../etc\n"))
    assert caught.value.field == "name"


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (None, "value"),  # the recipe's cosine schedule: rungs already see a decaying rate
        ("overrides: {optim.schedule: wsd}\n", "cooldown"),  # held peak rate: judged after a branch
    ],
)
def test_auto_rung_eval_follows_the_trials_schedule(change: str | None, expected: str) -> None:
    text = BASE if change is None else BASE + change
    space = sweepspace.parse(text)
    assert space.early_stopping.rung_eval == expected
    branch = "rung_cooldown.fraction" in space.trial_overrides(space.configurations()[0])
    assert branch is (expected == "cooldown")


def test_auto_rung_eval_with_a_swept_schedule_and_an_explicit_choice() -> None:
    swept = (
        BASE.replace(
            "parameters:\n", "parameters:\n  optim.schedule: {type: categorical, values: [cosine, wsd]}\n"
        )
        .replace("baseline:", "# baseline:")
        .replace("trials: 36,", "trials: 72,")
    )
    assert sweepspace.parse(swept).early_stopping.rung_eval == "cooldown"
    pinned = swept.replace("eta: 3}", "eta: 3, rung_eval: value}")
    assert sweepspace.parse(pinned).early_stopping.rung_eval == "value"
    # a training figure is never judged after a branch, whatever the schedule
    figure = swept.replace("name: val_loss", "name: loss")
    assert sweepspace.parse(figure).early_stopping.rung_eval == "value"


def test_early_stopping_with_no_settings_is_the_budgeted_rule_with_rungs_from_the_budget() -> None:
    """``early_stopping: {}`` names no rule and no rung: the budgeted rule, rungs at a 27th, a 9th
    and a third of the budget, evaluations at the first; ASHA still needs its ``min_steps``."""
    text = BASE.replace("early_stopping: {rule: asha, min_steps: 3, eta: 3}", "early_stopping: {}")
    text = text.replace("max_steps: 81", "max_steps: 243")
    space = sweepspace.parse(text)
    es = space.early_stopping
    assert (es.rule, es.min_steps, es.eta, es.rung_eval, es.branch) == ("budgeted", 9, 3, "value", 0.0)
    assert space.rungs() == [9, 27, 81]
    assert space.trial_overrides(space.configurations()[0])["eval_interval"] == 9
    assert sweepspace.from_dict(sweepspace.to_dict(space)) == space
    wsd = sweepspace.parse(text + "overrides: {optim.schedule: wsd}\n")
    assert wsd.early_stopping.rung_eval == "cooldown" and wsd.rungs() == [9, 27, 81]
    assert wsd.early_stopping.branch == 0.1
    assert space == sweepspace.parse(text.replace("early_stopping: {}", "early_stopping: {rule: budgeted}"))
    guarded = sweepspace.parse(text.replace("early_stopping: {}", "early_stopping: {rule: guarded}"))
    assert guarded.early_stopping.rule == "guarded" and guarded.rungs() == [9, 27, 81]
    with pytest.raises(ValidationError) as caught:
        sweepspace.parse(text.replace("early_stopping: {}", "early_stopping: {rule: asha}"))
    assert caught.value.field == "early_stopping.min_steps"
    with pytest.raises(ValidationError) as caught:
        sweepspace.parse(
            text.replace("early_stopping: {}", "early_stopping: {rule: guarded, min_steps: 243}")
        )
    assert caught.value.field == "early_stopping.min_steps"
    with pytest.raises(ValidationError) as caught:
        sweepspace.parse(text.replace("early_stopping: {}", "early_stopping: {form: stopping}"))
    assert caught.value.field == "early_stopping.form"
    # no early_stopping at all: no early stopping (an ablation runs every trial to the end)
    assert sweepspace.parse(text.replace("early_stopping: {}\n", "")).early_stopping.rule == "none"
