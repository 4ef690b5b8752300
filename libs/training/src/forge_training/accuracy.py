"""Pairwise accuracy and its interval, without torch: what the reward-model and DPO evaluations,
the reranker's first-rank accuracy and ``forge rm eval`` report.

A pair counts one when ranked right and one half on a tie (every pair at DPO's step 0 ties); the
95 % interval is the Wilson score interval, which stays inside [0, 1] and is sensible for small n.
"""

from __future__ import annotations

from dataclasses import dataclass

from forge_kit.stats import wilson_interval


@dataclass
class PairwiseTally:
    """Sums over scored pairs (loss, pairs ranked right, margin, pairs), the one evaluation of a
    pairwise objective: :meth:`figures` names them as the caller reports them."""

    loss: float = 0.0
    wins: float = 0.0
    margin: float = 0.0
    n: float = 0.0

    def add(self, loss: float, wins: float, margin: float, n: float) -> None:
        self.loss += loss
        self.wins += wins
        self.margin += margin
        self.n += n

    def as_list(self) -> list[float]:
        """In the order :meth:`from_list` reads (for an all-reduce over ranks)."""
        return [self.loss, self.wins, self.margin, self.n]

    @classmethod
    def from_list(cls, values: list[float]) -> PairwiseTally:
        loss, wins, margin, n = values
        return cls(loss, wins, margin, n)

    def figures(self, accuracy: str, margin: str) -> dict[str, float]:
        """``val_loss``, ``<accuracy>`` with ``_low``/``_high`` (Wilson), ``<margin>`` (means over
        the pairs) and ``eval_pairs``."""
        low, high = wilson_interval(self.wins, self.n)
        return {
            "val_loss": self.loss / self.n,
            accuracy: self.wins / self.n,
            f"{accuracy}_low": low,
            f"{accuracy}_high": high,
            margin: self.margin / self.n,
            "eval_pairs": self.n,
        }
