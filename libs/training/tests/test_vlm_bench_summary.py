"""The VLM benchmark's summary over one or several training seeds (no training: scored items)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from forge_training.bench import app
from forge_training.bench import vlm as vlm_bench
from forge_training.bench.vlm import SeedRun, _arm, summarise
from forge_training.vlm.evaluate import Scored

REFS = ["red", "circle", "two", "top left"]
GROUPS = ["colour", "shape", "count", "position"]


def _scored(preds: list[str]) -> dict[str, Scored]:
    scores = [float(p == r) for p, r in zip(preds, REFS, strict=True)]
    caps = Scored(["one shape: a big red circle."], ["one shape: a big red circle."], [1.0])
    return {
        "vqa": Scored(preds, REFS, scores, GROUPS),
        "text_only": Scored(["blue", "square", "two", "x"], REFS, [0.0, 0.0, 1.0, 0.0], GROUPS),
        "captions": caps,
    }


def _seed(seed: int, curriculum: list[str], joint: list[str]) -> SeedRun:
    scored = {"curriculum": _scored(curriculum), "joint": _scored(joint)}
    arms = {
        "curriculum": _arm(scored["curriculum"], 10.0, 100.0, {"vlm_align": 5}),
        "joint": _arm(scored["joint"], 12.0, 101.0, {"vlm_joint": 9}),
    }
    return SeedRun(seed, scored, arms, {"vlm_joint": {"wall_s": 12.0}}, 1.0)


def test_one_seed_summary_keeps_the_contract() -> None:
    s = summarise([_seed(0, ["red", "circle", "two", "top left"], ["red", "x", "two", "x"])])
    assert s["curriculum"]["vqa_accuracy"] == 1.0 and s["joint"]["vqa_accuracy"] == 0.5
    assert s["curriculum_vs_joint"]["delta"] == pytest.approx(0.5)
    assert s["curriculum_vs_joint"]["test"] == "mcnemar"
    assert s["text_only_accuracy"] == 0.25
    assert s["targets"]["both_beat_text_only_by_20_points"] is True
    assert s["per_seed"] == [] and s["seeds"] == [0]
    for arm in ("curriculum", "joint"):
        assert {"vqa_accuracy", "ci95", "caption_metric", "train_s"} <= set(s[arm])


def test_several_seeds_average_each_item_before_the_paired_comparison() -> None:
    runs = [
        _seed(0, ["red", "circle", "two", "top left"], ["red", "x", "two", "x"]),
        _seed(1, ["red", "x", "two", "top left"], ["x", "x", "two", "top left"]),
    ]
    s = summarise(runs)
    assert s["curriculum"]["vqa_accuracy"] == pytest.approx(7 / 8)
    assert s["joint"]["vqa_accuracy"] == pytest.approx(4 / 8)
    assert s["curriculum"]["vqa_by_type"] == {"colour": 1.0, "count": 1.0, "position": 1.0, "shape": 0.5}
    assert s["curriculum_vs_joint"]["delta"] == pytest.approx(3 / 8)
    assert s["curriculum_vs_joint"]["test"] == "sign-flip"  # per-item means are fractional
    assert s["curriculum"]["train_s"] == 20.0 and s["compute"]["joint_tokens"] == 202.0
    assert [p["seed"] for p in s["per_seed"]] == [0, 1]
    assert s["per_seed"][1]["curriculum_vs_joint"]["delta"] == pytest.approx(0.25)
    assert s["per_seed"][0]["joint"]["vqa_accuracy"] == 0.5
    low, high = s["curriculum"]["ci95"]
    assert low < 7 / 8 < high


def test_the_cli_trains_three_seeds_unless_told_one(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    asked: list[tuple[int, ...]] = []

    def record(out: Path, scale: float, seeds: tuple[int, ...], eval_limit: int, echo: Any) -> dict[str, Any]:
        asked.append(seeds)
        return summarise(
            [_seed(s, ["red", "circle", "two", "top left"], ["red", "x", "two", "x"]) for s in seeds]
        )

    monkeypatch.setattr(vlm_bench, "benchmark", record)
    runner = CliRunner()
    for args, seeds in (([], (0, 1, 2)), (["--seed", "4"], (4,)), (["--seeds", "5,6"], (5, 6))):
        result = runner.invoke(app, ["vlm", "--out", str(tmp_path / "out"), *args])
        assert result.exit_code == 0, result.output
        assert asked[-1] == seeds
    assert runner.invoke(app, ["vlm", "--out", str(tmp_path / "out"), "--seeds", ","]).exit_code != 0
