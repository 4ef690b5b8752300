"""The ``sweep`` workflow's signals, inputs, trials and result (plain data: Temporal carries them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from forge_experiments.earlystop import Rule, build
from forge_experiments.jobcmd import TrainCommand
from forge_experiments.rungtrust import rung_trust
from forge_experiments.sweepspace import Space
from forge_orchestrator.identity import Caller

#: Signal carrying one value of a trial's metric.
METRIC_SIGNAL = "trial_metric"
#: Memo key holding the name of the metric a sweep follows (read by the metrics consumer).
MEMO_METRIC = "forge_sweep_metric"
#: Job labels naming a trial's sweep and index (the tracking consumer files its MLflow run under
#: the sweep's parent run by them).
SWEEP_LABEL = "sweep_id"
TRIAL_LABEL = "trial"
#: Label of a promoted trial's job: the first job of the trial, whose checkpoints it resumes
#: (``--run-id``) and whose MLflow run it continues.
RESUMES_LABEL = "resumes_job"
ACTIVE = ("pending", "running", "preempted", "finishing")


@dataclass
class TrialMetric:
    """Payload of ``trial_metric``: the followed metric of a trial's job at ``step``."""

    job_id: str
    step: int
    value: float
    event_id: str = ""
    cooldown: bool = False
    """The value after a rung's cooldown branch (``cooldown_<metric>``), not the run's own."""


@dataclass
class SweepInput:
    space: str
    """The space file's text (YAML; see :mod:`forge_experiments.sweepspace`)."""
    team: str = ""
    """Team the trials are submitted for (the space's ``team``, which must agree when set)."""
    python: str = "python"
    """Interpreter on the nodes that runs the training entry point (:class:`forge_experiments.jobcmd.TrainCommand`)."""
    final_metric_wait_s: float = 60.0
    """How long a succeeded trial waits for its value at the full budget (it travels on another
    topic than the job's end) before its last value counts."""
    max_infra_retries: int = 3
    """Lost nodes per trial before it is given up (preemptions do not count)."""
    caller: Caller | None = None
    """Who started the sweep (set by the orchestrator from the caller's token); None: an admin."""
    checkpoint_wait_s: float = 0.0
    """How long a succeeded trial waits for its published checkpoint (``checkpoint_published``,
    its Hugging Face export) before it completes without one; 0: it does not wait (a caller that
    evaluates the trials' checkpoints, such as the ``cpt`` workflow, sets it)."""


@dataclass
class Trial:
    index: int
    config: int
    """Configuration index (trials of one configuration differ by seed)."""
    params: dict[str, Any]
    seed: int | None = None
    job_id: str = ""
    state: str = "pending"
    """pending, running, preempted, finishing (succeeded, final value not yet seen), paused (at
    a rung, ASHA's promotion form: its job ended with a checkpoint; promoted, it runs again as a
    new job resuming it), completed, stopped, failed, timed_out, cancelled."""
    reason: str = ""
    values: list[list[float]] = field(default_factory=list)
    """[step, value] of the followed metric, in arrival order."""
    rung_values: list[list[float]] = field(default_factory=list)
    """[step, value] of the metric after each rung's cooldown branch (``rung_eval: cooldown``)."""
    final: float | None = None
    stopped_at: int | None = None
    preemptions: int = 0
    infra_retries: int = 0
    submitted_at: float = 0.0
    running_since: float | None = None
    last_metric_at: float | None = None
    finishing_since: float | None = None
    gpu_seconds: float = 0.0
    run_id: str = ""
    first_job_id: str = ""
    """The trial's first job: every later job of the trial resumes its checkpoints."""
    jobs: int = 0
    """Jobs submitted for the trial (one more per promotion out of a pause)."""
    checkpoint_uri: str = ""
    """The newest published checkpoint of the trial's jobs (its Hugging Face export), when one
    arrived (signal ``checkpoint_published``)."""
    checkpoint_step: int = -1

    #: What the progress query and the report show of a trial.
    SUMMARY_FIELDS = (
        "index", "config", "params", "seed", "job_id", "state", "reason", "final", "stopped_at",
        "preemptions", "values", "rung_values", "run_id",
    )  # fmt: skip

    def summary(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.SUMMARY_FIELDS}


@dataclass
class SweepResult:
    name: str
    metric: str
    mode: str
    rungs: list[int]
    trials: list[Trial]
    best_trial: int | None = None
    best_metric: float | None = None
    gpu_hours: float = 0.0
    ignored_metrics: int = 0
    budget_exhausted: str = ""
    parent_run_id: str = ""
    summary: dict[str, Any] = field(default_factory=dict)
    """What the progress query answers, less the trials (the report reads both)."""


#: ``workflow.patched`` marker of the budgeted rule as the default (histories from before it
#: replay with the guarded rule, the default they ran under).
BUDGETED_RULE = "sweep-budgeted-rule"


def rule_of(space: Space, budgeted: bool = True) -> Rule | None:
    """The early-stopping rule the space names; ``budgeted`` False: a space naming the budgeted
    rule gets the guarded one (a sweep started before :data:`BUDGETED_RULE`)."""
    es = space.early_stopping
    rule = "guarded" if es.rule == "budgeted" and not budgeted else es.rule
    return build(rule, es.min_steps, es.eta, space.max_steps, space.mode, es.form, es.min_trials, es.branch)


def trust_of(space: Space, trials: list[Trial]) -> dict[str, Any]:
    """How far the sweep's rungs could be trusted (:func:`forge_experiments.rungtrust.rung_trust`), on
    the values its rule judged (the branches' under ``rung_eval: cooldown``)."""
    if not space.rungs():
        return {}
    cooled = space.early_stopping.rung_eval == "cooldown"
    curves = {str(t.index): [(int(s), v) for s, v in (t.rung_values if cooled else t.values)] for t in trials}
    finals = {str(t.index): t.final for t in trials if t.state == "completed" and t.final is not None}
    stopped = {
        str(t.index): t.stopped_at for t in trials if t.state == "stopped" and t.stopped_at is not None
    }
    return rung_trust(curves, finals, stopped, space.rungs(), space.mode)  # type: ignore[arg-type]


def trial_command(python: str, recipe: str, overrides: dict[str, Any]) -> list[str]:
    """The command line of one trial's job (:class:`forge_experiments.jobcmd.TrainCommand`)."""
    return TrainCommand.with_values(recipe, overrides, python).argv()


def run_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """The numbers of a sweep's summary that its MLflow parent run keeps when it is closed: the
    best value and trial, GPU-hours, trials per end state (``trials_completed``, …), and the
    rungs' trust (``rung_<r>_spearman``, ``rung_<r>_kendall``, ``noise``, ``stopped``,
    ``stopped_within_noise``)."""
    out = {f"trials_{state}": float(n) for state, n in summary.get("trials_by_state", {}).items()}
    for key in ("best_metric", "best_trial", "gpu_hours"):
        value = summary.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = float(value)
    trust = summary.get("trust") or {}  # how far the rungs could be trusted (trust_of)
    for rung, row in trust.get("rungs", {}).items():
        for name in ("spearman", "kendall"):
            if row.get(name) is not None:
                out[f"rung_{rung}_{name}"] = float(row[name])
    for name in ("noise", "stopped", "stopped_within_noise"):
        if name in trust:
            out[name] = float(trust[name])
    return out
