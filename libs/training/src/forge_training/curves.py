"""A run's loss and learning-rate curves as ``curves.png`` beside its ``metrics.jsonl``.

Drawn by rank 0 when a run ends (finished, stopped or preempted) from the metrics file itself, so
a resumed run's picture covers every attempt. Left: the training loss per logged step, with the
held-out ``val_loss`` points where they were measured; right: the learning rate (warmup and
cosine decay). matplotlib with the Agg backend: no display needed.
"""

from __future__ import annotations

import json
from pathlib import Path

CURVES_FILE = "curves.png"


def read_series(metrics: Path) -> dict[str, list[tuple[int, float]]]:
    """``loss``, ``val_loss`` and ``lr`` as (step, value) pairs, the last value of a step kept
    (a resumed run logs some steps twice); unreadable lines are skipped."""
    series: dict[str, dict[int, float]] = {"loss": {}, "val_loss": {}, "lr": {}}
    for line in metrics.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash mid-write
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            continue
        for key, points in series.items():
            value = row.get(key)
            if isinstance(value, int | float) and value == value:  # not NaN
                points[row["step"]] = float(value)
    return {key: sorted(points.items()) for key, points in series.items()}


def plot_curves(metrics: Path, out: Path | None = None) -> Path | None:
    """Write the curves of ``metrics`` to ``out`` (default: ``curves.png`` beside it); None when
    the file has no loss or learning rate to draw."""
    series = read_series(metrics)
    if not series["loss"] and not series["lr"]:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = out or metrics.with_name(CURVES_FILE)
    fig, (loss_ax, lr_ax) = plt.subplots(1, 2, figsize=(11, 4))
    if series["loss"]:
        loss_ax.plot(*zip(*series["loss"], strict=True), label="train loss", linewidth=1.2)
    if series["val_loss"]:
        loss_ax.plot(*zip(*series["val_loss"], strict=True), "o-", label="val loss", markersize=4)
    loss_ax.set(xlabel="step", ylabel="loss", title="loss")
    loss_ax.grid(alpha=0.3)
    if series["loss"] or series["val_loss"]:
        loss_ax.legend()
    if series["lr"]:
        lr_ax.plot(*zip(*series["lr"], strict=True), color="tab:orange", linewidth=1.2)
    lr_ax.set(xlabel="step", ylabel="learning rate", title="learning rate")
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    lr_ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = out.with_name(f".{out.name}.tmp")
    fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    tmp.replace(out)
    return out
