"""``curves.png``: the loss and learning-rate curves drawn from a run's ``metrics.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib import image

from forge_training.curves import plot_curves, read_series


def _metrics(path: Path) -> Path:
    rows = [
        {"step": 0, "val_loss": 4.0, "time_s": 0.1},
        *({"step": s, "loss": 4.0 - s / 10, "lr": 1e-3 * min(1.0, s / 3), "time_s": s} for s in range(1, 7)),
        {"step": 6, "val_loss": 3.5, "time_s": 6.5},
        {"step": 4, "loss": 3.55, "lr": 1e-3, "time_s": 7.0},  # a resumed attempt logs step 4 again
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 7, "loss"')  # a torn last line
    return path


def test_series_keep_the_last_value_of_each_step_and_skip_torn_lines(tmp_path: Path) -> None:
    series = read_series(_metrics(tmp_path / "metrics.jsonl"))
    assert [s for s, _ in series["loss"]] == [1, 2, 3, 4, 5, 6]
    assert dict(series["loss"])[4] == 3.55
    assert series["val_loss"] == [(0, 4.0), (6, 3.5)]
    assert dict(series["lr"])[1] == 1e-3 / 3


def test_the_png_is_written_beside_the_metrics(tmp_path: Path) -> None:
    written = plot_curves(_metrics(tmp_path / "metrics.jsonl"))
    assert written == tmp_path / "curves.png"
    pixels = image.imread(written)
    assert pixels.shape[0] == 400 and pixels.shape[1] == 1100  # 11 x 4 inches at 100 dpi
    assert not list(tmp_path.glob(".*.tmp"))
    (tmp_path / "empty.jsonl").write_text('{"step": 0, "val_loss": 4.0}\n')
    assert plot_curves(tmp_path / "empty.jsonl", tmp_path / "none.png") is None
