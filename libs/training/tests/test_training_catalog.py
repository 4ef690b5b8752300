"""The recipe catalogue other services check sweeps against matches the recipes, and a sweep
space refused there is refused by the recipes too."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from forge_experiments import sweepspace
from forge_kit import errors
from forge_training import catalog, recipes, schema


def test_shipped_catalogue_is_up_to_date() -> None:
    shipped = json.loads(resources.files("forge_experiments").joinpath("recipes.json").read_text())
    assert shipped == json.loads(catalog.rendered()), (
        "forge_experiments/recipes.json is stale: run python -m forge_training.catalog --write"
    )


def test_catalogue_keys_are_accepted_overrides_and_unused_sections_are_not_listed() -> None:
    entry = catalog.catalog()["sft_hh"]
    assert "optim.lr" in entry["keys"] and "model.hidden_size" not in entry["keys"]
    with pytest.raises(schema.RecipeError):
        recipes.build("sft_hh", {"model.hidden_size": 64})
    assert "val_loss" in catalog.catalog()["shakespeare_tiny"]["metrics"]


def test_space_trial_overrides_build_the_recipe() -> None:
    space = sweepspace.parse(
        """
name: s
recipe: smoke
metric: {name: val_loss}
parameters:
  optim.lr: {type: loguniform, low: 1.0e-3, high: 1.0e-2, grid_points: 2}
  model.num_layers: {type: int, low: 1, high: 2}
seeds: [1, 2]
gpu_type: SIM
budget: {trials: 8, gpu_hours: 1, max_steps: 27}
early_stopping: {rule: asha, min_steps: 3, eta: 3}
"""
    )
    assert len(space.grid()) == 4
    for params in space.grid():
        config = recipes.build(space.recipe, space.trial_overrides(params, seed=2))
        assert config.seed == 2 and config.max_steps == 27 and config.eval_interval == 3
    with pytest.raises(errors.ValidationError) as caught:
        sweepspace.parse(
            "name: s\nrecipe: smoke\nmetric: {name: pairwise_accuracy}\nparameters: {}\ngpu_type: SIM\nbudget: {}"
        )
    assert caught.value.field == "metric.name"
