"""Typed builders of the commands jobs run on a trainer node.

A service that submits a job says *what* to run (:class:`TrainCommand`,
:class:`PolicyCheckCommand`, :class:`RewardModelEvalCommand`) and gets the argument vector from here; none spells another
package's module names or flags. The programs are the training library's
(``forge_training.run``, ``forge_training.policy_check``, ``forge_training.rm.score``,
``forge_training.synthetic.job``), installed beside the trainer agent;
its tests parse what these builders produce with the programs' own argument parsers.

It lives here, not in the chassis: it is a contract between the submitters (the orchestrator's
workflows) and the training library's programs, torch-free like the recipe catalogue
(:mod:`forge_experiments.recipecatalog`) that checks the same recipes and overrides, and both sides
already depend on this library (the orchestrator without torch, ``forge_training`` on top of it).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

TRAIN_MODULE = "forge_training.run"
"""``python -m`` module of a training run (any recipe, any task)."""
POLICY_CHECK_MODULE = "forge_training.policy_check"
"""``python -m`` module of an RLHF drift check (KL, proxy reward, held-out agreement)."""
RM_SCORE_MODULE = "forge_training.rm.score"
"""``python -m`` module scoring preference pairs with a reward-model checkpoint."""
SYNTHETIC_MODULE = "forge_training.synthetic.job"
"""``python -m`` module of one stage of the synthetic-data workflow (curate, band, heldout)."""
SYNTHETIC_STAGES = ("curate", "band", "heldout")

_RECIPE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class JobCommandError(ValueError):
    """A job command that cannot be built; the message names the field."""


def render_value(value: object) -> str:
    """An override value as the recipe parser reads it: booleans ``true``/``false``, floats by
    ``repr`` (no digits lost), anything else by ``str``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _override(item: str) -> str:
    # The recipe parser names unknown keys; here only what would not reach it as one override.
    key, sep, _ = item.partition("=")
    if not sep or not key.strip() or key.startswith("-"):
        raise JobCommandError(f"overrides: {item!r} is not key=value")
    return item


@dataclass(frozen=True)
class TrainCommand:
    """``python -m forge_training.run --recipe RECIPE [--set key=value ...]``."""

    recipe: str
    overrides: tuple[str, ...] = ()
    """``key=value`` strings, in order (a later one wins)."""
    python: str = "python"
    """Interpreter on the node."""

    def __post_init__(self) -> None:
        if not _RECIPE.match(self.recipe):
            raise JobCommandError(f"recipe: {self.recipe!r} must be 1-128 letters, digits, '.', '_' or '-'")
        if not self.python:
            raise JobCommandError("python: must not be empty")
        object.__setattr__(self, "overrides", tuple(_override(o) for o in self.overrides))

    @classmethod
    def with_values(cls, recipe: str, values: Mapping[str, object], python: str = "python") -> TrainCommand:
        """Overrides from typed values (a sweep trial's), rendered by :func:`render_value`."""
        return cls(recipe, tuple(f"{k}={render_value(v)}" for k, v in values.items()), python)

    def argv(self) -> list[str]:
        sets = [arg for item in self.overrides for arg in ("--set", item)]
        return [self.python, "-m", TRAIN_MODULE, "--recipe", self.recipe, *sets]


@dataclass(frozen=True)
class PolicyCheckCommand:
    """``python -m forge_training.policy_check``: each policy checkpoint against the reference
    under a reward model, on held-out pairs; writes ``<out>/summary.json``."""

    reference: str
    reward_model: str
    pairs: str
    out: str
    policies: Sequence[str] = field(default_factory=tuple)
    max_prompts: int = 32
    max_new_tokens: int = 24
    seed: int = 0
    python: str = "python"

    def __post_init__(self) -> None:
        for name in ("reference", "reward_model", "pairs", "out", "python"):
            if not getattr(self, name):
                raise JobCommandError(f"{name}: must not be empty")
        object.__setattr__(self, "policies", tuple(self.policies))
        if not self.policies or not all(self.policies):
            raise JobCommandError("policies: name at least one policy checkpoint, none empty")
        if self.max_prompts < 1 or self.max_new_tokens < 1:
            raise JobCommandError("max_prompts, max_new_tokens: must be >= 1")

    def argv(self) -> list[str]:
        command = [
            self.python,
            "-m",
            POLICY_CHECK_MODULE,
            "--reference",
            self.reference,
            "--reward-model",
            self.reward_model,
            "--pairs",
            self.pairs,
            "--out",
            self.out,
            "--max-prompts",
            str(self.max_prompts),
            "--max-new-tokens",
            str(self.max_new_tokens),
            "--seed",
            str(self.seed),
        ]
        for policy in self.policies:
            command += ["--policy", policy]
        return command


@dataclass(frozen=True)
class RewardModelEvalCommand:
    """``python -m forge_training.rm.score``: held-out pairwise accuracy of a reward-model
    checkpoint on a pairs file; writes ``<out>/summary.json`` (``accuracy``, ``ci95_low``,
    ``ci95_high``, ``n``)."""

    checkpoint: str
    pairs: str
    out: str
    python: str = "python"

    def __post_init__(self) -> None:
        for name in ("checkpoint", "pairs", "out", "python"):
            if not getattr(self, name):
                raise JobCommandError(f"{name}: must not be empty")

    def argv(self) -> list[str]:
        return [
            self.python,
            "-m",
            RM_SCORE_MODULE,
            "--checkpoint",
            self.checkpoint,
            "--pairs",
            self.pairs,
            "--out",
            self.out,
        ]


_OPTION = re.compile(r"^[a-z][a-z0-9-]{0,63}$")


@dataclass(frozen=True)
class SyntheticStageCommand:
    """``python -m forge_training.synthetic.job STAGE --work DIR [--option value ...]``: one stage
    of the synthetic-data workflow over the run's folder; writes ``DIR/<stage>.json``."""

    stage: str
    work: str
    options: Sequence[tuple[str, str]] = field(default_factory=tuple)
    """(option name without dashes, value) pairs, in order."""
    python: str = "python"

    def __post_init__(self) -> None:
        if self.stage not in SYNTHETIC_STAGES:
            raise JobCommandError(f"stage: must be one of {', '.join(SYNTHETIC_STAGES)}, got {self.stage!r}")
        for name in ("work", "python"):
            if not getattr(self, name):
                raise JobCommandError(f"{name}: must not be empty")
        object.__setattr__(self, "options", tuple((str(k), str(v)) for k, v in self.options))
        for key, _ in self.options:
            if not _OPTION.match(key):
                raise JobCommandError(f"options: {key!r} is not an option name")

    def argv(self) -> list[str]:
        command = [self.python, "-m", SYNTHETIC_MODULE, self.stage, "--work", self.work]
        for key, value in self.options:
            command += [f"--{key}", value]
        return command
