"""PNG plots of a replay: utilisation over time and the longest wait per team over time."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from forge_scheduler.sim.replay import ReplayResult


def plot_replay(results: Sequence[ReplayResult], out: Path) -> None:
    """``utilization.png`` (all policies) and ``queue_by_team_<policy>.png`` (one per policy)."""
    fig, ax = plt.subplots(figsize=(10, 4))
    for r in results:
        days = [t / 86400 for t in r.series_t]
        ax.plot(days, _smooth(r.series_util, 24), label=r.policy, linewidth=1)
    ax.set_xlabel("days since first submit")
    ax.set_ylabel("GPU utilisation (24 h mean)")
    ax.set_ylim(0, 1.05)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "utilization.png", dpi=100)
    plt.close(fig)
    for r in results:
        fig, ax = plt.subplots(figsize=(10, 4))
        for team, series in sorted(r.series_queue_by_team.items()):
            ax.plot([t / 86400 for t, _ in series], [w / 3600 for _, w in series], label=team, linewidth=0.8)
        ax.set_xlabel("days since first submit")
        ax.set_ylabel("longest current wait (h)")
        ax.set_title(f"queue time by team — {r.policy}")
        ax.legend(fontsize=6, ncol=3)
        fig.tight_layout()
        fig.savefig(out / f"queue_by_team_{r.policy}.png", dpi=100)
        plt.close(fig)


def _smooth(values: Sequence[float], window: int) -> list[float]:
    out: list[float] = []
    acc = 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out
