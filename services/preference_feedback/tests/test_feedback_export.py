"""Training snapshots: accepted pairs in HH-RLHF format, flagged raters excluded with the reason."""

from __future__ import annotations

import datetime as dt
import gzip
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from forge.common.v1 import common_pb2
from typer.testing import CliRunner

from forge_kit.db import Database
from forge_preference_feedback.cli import app
from forge_preference_feedback.seeds import read_hh_rlhf, split_pair
from forge_preference_feedback.service import FeedbackService

if TYPE_CHECKING:
    from conftest import Clock

A, B, TIE = common_pb2.PREFERENCE_CHOICE_A, common_pb2.PREFERENCE_CHOICE_B, common_pb2.PREFERENCE_CHOICE_TIE


def read(path: Path) -> list[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


async def rate_all(service: FeedbackService, clock: Clock, rater: str, pick: str) -> None:
    """``pick``: "gold" answers as HH-RLHF did, "flip" the other side, "tie" always tie."""
    while (item := await service.next_comparison(rater)) is not None:
        clock.advance(10)
        gold = A if item.gold_choice == "A" else B
        choice = {"gold": gold, "flip": B if gold == A else A, "tie": TIE}[pick]
        await service.submit_preference(item.id, rater, choice, 1.0, "")


@pytest.mark.asyncio
async def test_export_writes_pairs_and_excludes_a_flagged_rater(
    db: Database, clock: Clock, hh_root: Path, tmp_path: Path
) -> None:
    service = FeedbackService(db, clock=clock, lease=dt.timedelta(seconds=60), overlap=5)
    await service.seed_comparisons(read_hh_rlhf(hh_root), limit=12, rng_seed=0)
    for rater in ["h1", "h2", "h3"]:
        await rate_all(service, clock, rater, "gold")
    await rate_all(service, clock, "flipper", "flip")
    await rate_all(service, clock, "undecided", "tie")

    manifest = await service.export_snapshot(tmp_path / "snap", heldout_fraction=0.25)
    assert list(manifest.excluded_raters) == ["flipper", "undecided"]
    assert "anti-correlated" in manifest.excluded_raters["flipper"][0]
    assert manifest.excluded == {"flagged_rater": 12, "tie_or_both_bad": 12}
    train, test = read(tmp_path / "snap" / "train.jsonl.gz"), read(tmp_path / "snap" / "test.jsonl.gz")
    assert (len(train), len(test)) == (manifest.train_pairs, manifest.test_pairs)
    assert len(train) + len(test) == 36 and len(test) > 0
    # The held-out split is by comparison: no comparison is on both sides.
    assert not {r["comparison_id"] for r in train} & {r["comparison_id"] for r in test}
    # Honest raters answered as HH-RLHF did: every exported pair is the original pair again.
    originals = {(p.prompt, p.chosen, p.rejected) for p in read_hh_rlhf(hh_root)}
    for row in train + test:
        assert split_pair(row["chosen"], row["rejected"]) in originals
        assert row["rater_id"] in {"h1", "h2", "h3"} and row["weight"] > 0.5
    assert (
        json.loads((tmp_path / "snap" / "manifest.json").read_text())["snapshot_id"] == manifest.snapshot_id
    )
    # Same data, same snapshot id; an existing snapshot is never overwritten.
    again = await service.export_snapshot(tmp_path / "snap2", heldout_fraction=0.25)
    assert again.snapshot_id == manifest.snapshot_id
    with pytest.raises(FileExistsError):
        await service.export_snapshot(tmp_path / "snap", heldout_fraction=0.25)


def test_cli_adds_raters_and_exports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = CliRunner()
    monkeypatch.setenv("FORGE_FEEDBACK_PASSWORD", "a long enough password")
    added = runner.invoke(app, ["add-rater", "ops", "--admin", "--data-dir", str(tmp_path)])
    assert added.exit_code == 0 and "rater ops added (admin)" in added.output
    twice = runner.invoke(app, ["add-rater", "ops", "--data-dir", str(tmp_path)])
    assert twice.exit_code == 2 and "already exists" in twice.output
    monkeypatch.setenv("FORGE_FEEDBACK_PASSWORD", "short")
    short = runner.invoke(app, ["add-rater", "newbie", "--data-dir", str(tmp_path)])
    assert short.exit_code == 2 and "password: must be 8 to 256 characters" in short.output

    out = tmp_path / "snapshot"
    exported = runner.invoke(app, ["export", "--out", str(out), "--data-dir", str(tmp_path)])
    assert exported.exit_code == 0, exported.output
    assert json.loads(exported.output)["train_pairs"] == 0 and (out / "manifest.json").is_file()
    again = runner.invoke(app, ["export", "--out", str(out), "--data-dir", str(tmp_path)])
    assert again.exit_code == 2 and "already exists" in again.output
