"""Rung evaluations after a cooldown branch (``rung_cooldown.*`` recipe keys).

An early-stopping rung compares trials by their metric after a fraction of the budget. Trained at
a rate that only decays at the end (``optim.schedule=wsd``, or early in a long cosine), a trial's
value at a rung says how far it got *at its current rate*, not where it will end once the rate
anneals: high rates lead early and lose later (successive halving's short-horizon bias). WSD
practice (Hu et al. 2024, MiniCPM; Hägele et al. 2024) reads the final loss off short *cooldowns*:
from the current state, decay the rate to zero over a fraction of the steps so far and evaluate.

At each rung ``min_steps · eta^k`` below ``max_steps`` the loop calls :func:`run_branch`, which

1. keeps the model's parameters and buffers, the optimizer state (and with it every group's rate)
   and the RNGs;
2. trains ``n = ceil(fraction · step)`` steps (at most the steps left) on the batches the run
   will train on next, at rates falling linearly from the current rate (``lr · (n - i) / n`` at
   branch step ``i``, per parameter group);
3. evaluates (``objective.evaluate``) and restores everything kept in 1.

The run then continues exactly as it would have without the branch (the same batches, states and
RNGs); the branch's figures go to ``metrics.jsonl`` as ``cooldown_<name>`` at the rung's step,
with ``cooldown_steps`` (n), and its steps are counted in ``TrainResult.branch_steps``: they cost
compute like any other step.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from forge_experiments.earlystop import rungs
from forge_experiments.sweepspace import COOLDOWN_PREFIX as PREFIX
from forge_training.schema import TrainConfig

__all__ = ["PREFIX", "STEPS_KEY", "branch_steps", "run_branch"]
#: The branch length's key in the same line.
STEPS_KEY = "cooldown_steps"

B = TypeVar("B")


def branch_steps(config: TrainConfig) -> dict[int, int]:
    """Rung step → branch length, for a run with ``rung_cooldown.fraction`` > 0 (else empty)."""
    rc = config.rung_cooldown
    if rc.fraction <= 0 or rc.min_steps < 1:
        return {}
    return {
        r: min(math.ceil(rc.fraction * r), config.max_steps - r)
        for r in rungs(rc.min_steps, rc.eta, config.max_steps)
    }


def _rng() -> tuple[Any, ...]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), random.getstate(), np.random.get_state(), cuda


def _set_rng(state: tuple[Any, ...]) -> None:
    torch.set_rng_state(state[0])
    random.setstate(state[1])
    np.random.set_state(state[2])
    if state[3] is not None:
        torch.cuda.set_rng_state_all(state[3])


def run_branch(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Sequence[B],
    step: Callable[[B], None],
    evaluate: Callable[[], dict[str, float]],
) -> dict[str, float]:
    """Steps 1-3 of the module docstring: ``step(batch)`` trains one optimizer step at the
    groups' current rates (forward, backward, clip, ``optimizer.step``, zero the gradients);
    returns ``evaluate()`` after the last branch step. Every rank calls it at the same step."""
    kept_tensors = [t.detach().clone() for t in (*model.parameters(), *model.buffers())]
    kept_optim = copy.deepcopy(optimizer.state_dict())
    kept_rng = _rng()
    peaks = [group["lr"] for group in optimizer.param_groups]
    n = len(batches)
    try:
        for i, batch in enumerate(batches):
            for group, peak in zip(optimizer.param_groups, peaks, strict=True):
                group["lr"] = peak * (n - i) / n
            step(batch)
        return evaluate()
    finally:
        with torch.no_grad():
            for t, kept in zip((*model.parameters(), *model.buffers()), kept_tensors, strict=True):
                t.copy_(kept)
        optimizer.load_state_dict(kept_optim)
        optimizer.zero_grad(set_to_none=True)
        _set_rng(kept_rng)
