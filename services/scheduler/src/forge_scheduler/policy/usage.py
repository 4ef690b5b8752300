"""Decayed historical usage per team (Slurm-style half-life), integrated exactly between calls."""

from __future__ import annotations

import math
from collections.abc import Mapping


class UsageLedger:
    """Each team's GPU-seconds, decayed with ``half_life_s``; the caller advances it with its clock.

    Between two ``advance`` calls a team's allocation is constant, so the decayed integral has a
    closed form: u' = u·e^(-λΔt) + r·(1 - e^(-λΔt))/λ, with λ = ln 2 / half-life.
    """

    def __init__(self, half_life_s: float, start: float = 0.0) -> None:
        if half_life_s <= 0:
            raise ValueError("half_life_s: must be positive")
        self._lambda = math.log(2) / half_life_s
        self._now = start
        self._usage: dict[str, float] = {}

    def advance(self, now: float, gpus_by_team: Mapping[str, int]) -> None:
        """Account ``gpus_by_team`` (held since the last call) up to ``now``."""
        dt = now - self._now
        if dt < 0:
            raise ValueError("now: the clock went backwards")
        if dt == 0:
            return
        decay = math.exp(-self._lambda * dt)
        gain = (1.0 - decay) / self._lambda
        for team in list(self._usage):
            self._usage[team] *= decay
        for team, gpus in gpus_by_team.items():
            self._usage[team] = self._usage.get(team, 0.0) + gpus * gain
        self._now = now

    def snapshot(self) -> dict[str, float]:
        return dict(self._usage)
