"""The objective registry: one entry per recipe task, each building that task's objective."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from forge_training import recipes, schema
from forge_training.objectives import OBJECTIVES, build_objective


def test_every_recipe_task_has_one_registered_objective() -> None:
    assert set(OBJECTIVES) == set(schema.TASKS)
    assert all(spec.task == task and spec.summary for task, spec in OBJECTIVES.items())


def test_the_registry_builds_the_tasks_objective(tmp_path: Path) -> None:
    config = recipes.build("smoke", {"data.corpus": str(_corpus(tmp_path))})
    objective = build_objective(config, 0, 1, tmp_path / "cache")
    assert objective.task == "pretrain" and type(objective).__module__.endswith("objectives.pretrain")


def test_an_unknown_task_is_refused_by_name(tmp_path: Path) -> None:
    config = dataclasses.replace(recipes.build("smoke", {}), task="telepathy")
    with pytest.raises(ValueError, match="task: unknown task 'telepathy'"):
        build_objective(config, 0, 1, tmp_path)


def _corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("To be, or not to be, that is the question.\n" * 400, encoding="utf-8")
    return path
