"""``forge bench cpt`` end to end at tiny sizes: a parent, the mixture search as sweeps, the
paired measurements, the rule's mixture and checkpoint (or its clear refusal), and the files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from forge_training.bench import app

# A whole bench (parent, search, final run) in the module fixture: minutes on a loaded machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TINY = ["--parent-steps", "12", "--search-steps", "6", "--final-steps", "6", "--windows", "24",
        "--fractions", "0.1,0.5", "--lrs", "1e-3,3e-3", "--quiet"]  # fmt: skip


@pytest.fixture(scope="module")
def chosen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cpt") / "out"
    result = CliRunner().invoke(app, ["cpt", "--out", str(out), "--max-forgetting", "10", *TINY])
    assert result.exit_code == 0, result.output
    return out


def test_search_curve_final_run_and_chosen_checkpoint(chosen: Path) -> None:
    summary = json.loads((chosen / "summary.json").read_text())
    search = [r for r in summary["curve"] if r["stage"] == "search"]
    final = [r for r in summary["curve"] if r["stage"] == "final"]
    assert {(r["general_fraction"], r["lr"]) for r in search} <= {
        (0.1, 1e-3),
        (0.1, 3e-3),
        (0.5, 1e-3),
        (0.5, 3e-3),
    }
    assert len(search) + len([t for t in summary["search"]["trials"] if t["val_loss"] is None]) == 4
    assert [r["steps"] for r in final] == [2, 4, 6]  # a checkpoint every third of the final run
    for r in summary["curve"]:
        assert r["n_domain"] == r["n_general"] == 24
        assert r["forgetting_ci95"][0] <= r["forgetting"] <= r["forgetting_ci95"][1]
        assert r["general_loss"] - summary["base"]["general_loss"] == pytest.approx(r["forgetting"], abs=1e-9)
    assert summary["outcome"] == "chosen" and summary["chosen"]["label"] in {
        r["label"] for r in summary["curve"]
    }
    mixture = (summary["mixture"]["general_fraction"], summary["mixture"]["lr"])
    assert mixture == (final[0]["general_fraction"], final[0]["lr"])
    assert (chosen / "mixture.md").read_text().count("| search |") == len(search)
    assert (chosen / "mixture.png").read_bytes()[:4] == b"\x89PNG"


def test_no_admissible_mixture_ends_before_the_final_run(chosen: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    # The corpora as the first run tokenised them with this parent (the cache is keyed by the
    # text, the settings and the tokenizer): what a second bench from the same parent reuses.
    shutil.copytree(chosen / "cache", out / "cache")
    args = ["cpt", "--out", str(out), "--parent", str(chosen / "runs" / "parent" / "hf"), *TINY]
    args += ["--fractions", "0.5", "--lrs", "1e-3", "--max-forgetting", "0", "--min-domain-gain", "5"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["outcome"] == "none_admissible" and summary["chosen"] is None
    assert "no checkpoint meets the rule" in summary["reason"]
    assert not [r for r in summary["curve"] if r["stage"] == "final"] and "final" not in summary
    assert not (out / "runs" / "parent").exists()  # the given parent was used


def test_bad_options_are_refused_before_training(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["cpt", "--out", str(tmp_path), "--fractions", "0.1,1.5"])
    assert result.exit_code != 0 and "general_fractions[1]" in result.output
    result = CliRunner().invoke(app, ["cpt", "--out", str(tmp_path), "--bound", "mean"])
    assert result.exit_code != 0 and "rule.bound" in result.output
    assert not (tmp_path / "runs").exists()
