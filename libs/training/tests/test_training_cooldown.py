"""Rung evaluations after a cooldown branch (``rung_cooldown.*``): the branch's figures are logged
at each rung with its length, its steps are counted, and the run goes on exactly as without it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forge_kit.objectstore import ObjectStore
from forge_training import cooldown, recipes, schema
from forge_training.prefetch import Prefetcher
from forge_training.train import RunContext, TrainResult, train
from forge_training.validation import validate


def _run(tmp_path: Path, name: str, **overrides: object) -> tuple[TrainResult, list[dict[str, float]]]:
    config = recipes.build("smoke", {"max_steps": 20, "eval_interval": 1, **overrides})
    run_dir = tmp_path / name
    ctx = RunContext(
        run_id=name,
        run_dir=run_dir,
        store=ObjectStore(str(tmp_path / "objects")),
        cache_dir=tmp_path,
        export=False,
    )
    result = train(config, ctx)
    return result, [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_branches_at_rungs_are_logged_counted_and_leave_the_run_unchanged(tmp_path: Path) -> None:
    plain, plain_lines = _run(tmp_path, "plain")
    cooled, lines = _run(
        tmp_path,
        "cooled",
        **{"rung_cooldown.fraction": 0.5, "rung_cooldown.min_steps": 3, "rung_cooldown.eta": 2},
    )
    # Rungs 3, 6, 12 below 20 steps: branches of ceil(0.5 * step) = 2, 3, 6 steps.
    branches = [(row["step"], row[cooldown.STEPS_KEY]) for row in lines if cooldown.STEPS_KEY in row]
    assert branches == [(3, 2), (6, 3), (12, 6)] and cooled.branch_steps == 11 and plain.branch_steps == 0
    assert all(
        set(row) >= {"cooldown_val_loss", "cooldown_val_ppl"} for row in lines if cooldown.STEPS_KEY in row
    )
    # The run itself: the same losses and evaluations, step for step, as without branches.
    assert cooled.losses == plain.losses and cooled.eval_metrics == plain.eval_metrics and cooled.step == 20
    own = [(r["step"], r["val_loss"]) for r in lines if "val_loss" in r]
    assert own == [(r["step"], r["val_loss"]) for r in plain_lines if "val_loss" in r]
    # Annealed, the branch ends below the run's own value at the same step (the rate's noise gone).
    at = {r["step"]: r["val_loss"] for r in lines if "val_loss" in r}
    assert all(r["cooldown_val_loss"] < at[r["step"]] for r in lines if cooldown.STEPS_KEY in r)


def test_branch_lengths_follow_the_rungs_and_stop_at_the_budget() -> None:
    config = recipes.build(
        "smoke",
        {
            "max_steps": 100,
            "rung_cooldown.fraction": 0.2,
            "rung_cooldown.min_steps": 9,
            "rung_cooldown.eta": 3,
        },
    )
    assert cooldown.branch_steps(config) == {9: 2, 27: 6, 81: 17}
    short = recipes.build(
        "smoke",
        {
            "max_steps": 85,
            "rung_cooldown.fraction": 1.0,
            "rung_cooldown.min_steps": 9,
            "rung_cooldown.eta": 3,
        },
    )
    assert cooldown.branch_steps(short) == {9: 9, 27: 27, 81: 4}  # no branch past max_steps
    assert cooldown.branch_steps(recipes.build("smoke")) == {}  # off by default


@pytest.mark.parametrize(
    ("key", "value"),
    [("rung_cooldown.fraction", 1.5), ("rung_cooldown.eta", 1), ("rung_cooldown.min_steps", 10)],
)
def test_bad_branch_settings_are_refused_naming_the_key(key: str, value: float) -> None:
    base: dict[str, object] = {"rung_cooldown.fraction": 0.2, "rung_cooldown.min_steps": 3}
    config = recipes.build("smoke", {**base, key: value})
    with pytest.raises(schema.RecipeError, match=key.replace(".", r"\.")):
        validate(config, 1)


def test_peeked_items_are_handed_out_again_in_order() -> None:
    produced = iter(range(100))
    prefetch = Prefetcher(lambda: next(produced), count=6, depth=2)
    assert prefetch.next() == 0
    assert prefetch.peek(3) == [1, 2, 3] and prefetch.peek(2) == [1, 2]
    assert [prefetch.next() for _ in range(2)] == [1, 2]
    assert prefetch.peek(10) == [3, 4, 5]  # no more than the count left
    assert [prefetch.next() for _ in range(3)] == [3, 4, 5]
    with pytest.raises(StopIteration):
        prefetch.next()
    prefetch.close()
