"""Sweep and ablation spaces: the YAML format, its validation, and the configurations it names.

A space file (see ``load/sweep/space.yaml``)::

    name: lr-width                       # 1-64 letters, digits, '.', '_', '-'
    recipe: shakespeare_tiny             # a recipe of the catalogue (forge_experiments/recipes.json)
    metric: {name: val_loss, mode: min}  # a metric the recipe emits
    sampler: grid                        # grid | random | tpe
    seed: 0                              # sampler seed
    parameters:                          # recipe override keys
      optim.lr: {type: loguniform, low: 3.0e-4, high: 1.0e-2, grid_points: 3}
      optim.weight_decay: {type: uniform, low: 0.0, high: 0.2, grid_points: 2}
      optim.warmup_steps: {type: int, low: 10, high: 50, step: 20}
      model.hidden_size: {type: categorical, values: [64, 128]}
    overrides: {data.vocab_size: 300}    # fixed overrides of every trial
    seeds: [1, 2, 3]                     # optional ablation: every configuration x these seeds
    baseline: {optim.lr: 1.0e-3}         # optional: the configuration others are compared with
    budget: {trials: 24, gpu_hours: 4, max_steps: 243}
    concurrency: 4
    team: research
    priority_class: preemptible
    gpus_per_trial: 1                    # devices per trial (a training job asks for at least 1)
    gpu_type: H100                       # device type of the trials (SIM on forge up's agents)
    early_stopping: {}                   # the budgeted rule (forge_experiments.earlystop: complete
                                         # rungs, a scale-free margin, finishers within half the
                                         # grid's steps), rungs at max_steps / 27, / 9, / 3;
                                         # or {rule: guarded|asha, min_steps,
                                         # eta, form: promotion|stopping, rung_eval: auto|value|
                                         # cooldown, cooldown_fraction}, median or none

Everything is checked before any job exists; a :class:`~forge_kit.errors.ValidationError` names
the offending field (``parameters.optim.lr.low``, ``budget.trials`` …).
"""

from __future__ import annotations

import itertools
import math
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import yaml

from forge_experiments.earlystop import default_min_steps, rungs
from forge_experiments.recipecatalog import recipe_catalog
from forge_kit.errors import ValidationError

MAX_FILE_BYTES = 256 * 1024
MAX_PARAMETERS = 32
MAX_VALUES = 256
MAX_TRIALS = 2000
MAX_SEEDS = 64
#: Bound on the sweep workflow's history: about a dozen events per trial plus one signal per
#: evaluation of its metric must stay well below Temporal's 51,200-event limit per workflow run.
MAX_HISTORY_EVENTS = 40_000
EVENTS_PER_TRIAL = 12
SAMPLERS = ("grid", "random", "tpe")
RULES = ("budgeted", "guarded", "asha", "median", "none")
RUNG_RULES = ("budgeted", "guarded", "asha")  # rules that judge trials at rungs
GUARDED_RULES = ("budgeted", "guarded")  # rules pausing trials at complete rungs (promotion form)
DEFAULT_RULE = "budgeted"  # the rule of an ``early_stopping`` mapping that names none
#: ASHA's forms (``early_stopping.form``).
ASHA_FORMS = ("promotion", "stopping")
#: What ASHA compares at a rung (``early_stopping.rung_eval``): the metric as the trial reports
#: it, after a cooldown branch (``forge_training.cooldown``), or ``auto`` (the default): a
#: cooldown where a trial's schedule holds its peak rate until a late decay, the value otherwise.
RUNG_EVALS = ("auto", "value", "cooldown")
#: Schedules (``optim.schedule``) that keep the peak rate until a final decay: a rung's value is
#: taken at the peak rate, where larger rates lead, so ``auto`` judges such trials after a branch.
HOLD_PEAK_SCHEDULES = ("wsd",)
#: Prefix of a figure measured after a rung's cooldown branch (``cooldown_val_loss``), as the
#: training loop writes it and the sweep follows it.
COOLDOWN_PREFIX = "cooldown_"
#: Per-step training figures: no evaluation, so no cooldown branch reports them.
_STEP_FIGURES = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu")
TYPES = ("categorical", "uniform", "loguniform", "int")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_TEAM = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_KEY = re.compile(r"^[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)*$")
_TOP = frozenset(
    [
        "name",
        "recipe",
        "metric",
        "sampler",
        "seed",
        "parameters",
        "overrides",
        "seeds",
        "baseline",
        "budget",
        "concurrency",
        "team",
        "priority_class",
        "gpus_per_trial",
        "gpu_type",
        "early_stopping",
        "trial_timeout_s",
        "metrics_timeout_s",
    ]
)

Value = float | int | str | bool


@dataclass(frozen=True)
class Parameter:
    key: str
    type: str
    low: float = 0.0
    high: float = 0.0
    step: int = 1
    values: tuple[Value, ...] = ()
    grid_points: int = 0

    def grid(self) -> list[Value]:
        """Grid values: the categories; every int ``low..high`` by ``step``; ``grid_points``
        evenly spaced (in log space for ``loguniform``) points of a continuous range."""
        if self.type == "categorical":
            return list(self.values)
        if self.type == "int":
            return list(range(int(self.low), int(self.high) + 1, self.step))
        n = self.grid_points
        if self.type == "loguniform":
            lo, hi = math.log(self.low), math.log(self.high)
            return [float(f"{math.exp(lo + (hi - lo) * i / (n - 1)):.6g}") for i in range(n)]
        return [float(f"{self.low + (self.high - self.low) * i / (n - 1):.6g}") for i in range(n)]

    def sample(self, rng: random.Random) -> Value:
        if self.type == "categorical":
            return self.values[rng.randrange(len(self.values))]
        if self.type == "int":
            return rng.randrange(int(self.low), int(self.high) + 1, self.step)
        if self.type == "loguniform":
            return float(f"{math.exp(rng.uniform(math.log(self.low), math.log(self.high))):.6g}")
        return float(f"{rng.uniform(self.low, self.high):.6g}")


@dataclass(frozen=True)
class EarlyStopping:
    rule: str = "none"
    min_steps: int = 1
    eta: int = 3
    min_trials: int = 3
    form: str = "promotion"
    """ASHA's form (:mod:`forge_experiments.earlystop`): ``promotion`` (pause at a rung, resumed when
    promoted) or ``stopping`` (go on or stop at once)."""
    rung_eval: str = "value"
    """``value``: rungs compare the metric as reported; ``cooldown``: as reported after a branch
    that decays the rate to zero over ``cooldown_fraction`` of the steps so far (the trial then
    goes on from before the branch; its steps count as the trial's). A parsed space holds the
    resolved choice (``auto`` in the file becomes one of the two, :func:`resolve_rung_eval`)."""
    cooldown_fraction: float = 0.1
    """Branch length as a share of the steps so far: its steps count against the sweep's compute
    (0.1 and 0.2 measured in load/sweep/RESULTS.md)."""

    @property
    def branch(self) -> float:  # each rung's cooldown branch as a share of the rung (0: none)
        return self.cooldown_fraction if self.rung_eval == "cooldown" else 0.0


@dataclass(frozen=True)
class Space:
    name: str
    recipe: str
    metric: str
    mode: str
    sampler: str
    parameters: tuple[Parameter, ...]
    trials: int
    gpu_hours: float
    max_steps: int
    overrides: dict[str, Value] = field(default_factory=dict)
    seeds: tuple[int, ...] = ()
    baseline: dict[str, Value] = field(default_factory=dict)
    seed: int = 0
    concurrency: int = 4
    team: str = ""
    priority_class: str = "preemptible"
    gpus_per_trial: int = 1
    gpu_type: str = ""
    early_stopping: EarlyStopping = field(default_factory=EarlyStopping)
    trial_timeout_s: float = 6 * 3600.0
    metrics_timeout_s: float = 1800.0
    """A running trial with no metric for this long is cancelled and recorded as timed out."""

    @property
    def keys(self) -> list[str]:
        return [p.key for p in self.parameters]

    def rungs(self) -> list[int]:
        es = self.early_stopping
        return rungs(es.min_steps, es.eta, self.max_steps) if es.rule in RUNG_RULES else []

    def grid(self) -> list[dict[str, Value]]:
        """Every configuration of the grid, in a fixed order (the last parameter fastest)."""
        axes = [p.grid() for p in self.parameters]
        return [dict(zip(self.keys, combo, strict=True)) for combo in itertools.product(*axes)]

    def configurations(self) -> list[dict[str, Value]]:
        """The configurations a grid sweep (or the benchmark) runs: the grid for ``grid``; for
        ``random``/``tpe``, ``trials`` (divided by the seeds) configurations drawn with ``seed``."""
        if self.sampler == "grid":
            return self.grid()
        rng = random.Random(self.seed)
        count = max(1, self.trials // max(1, len(self.seeds)))
        return [{p.key: p.sample(rng) for p in self.parameters} for _ in range(count)]

    def trial_overrides(
        self, params: Mapping[str, Value], seed: int | None = None, *, branches: bool = True
    ) -> dict[str, Value]:
        """Every override of one trial: the fixed ones, the budget, the metric's cadence, the
        rungs' cooldown branches (``rung_eval: cooldown``, unless ``branches`` is False: a trial
        that no rung judges), the sampled parameters and the seed."""
        out: dict[str, Value] = {"max_steps": self.max_steps}
        es = self.early_stopping
        if es.rule != "none" and "eval_interval" not in self.overrides:
            out["eval_interval"] = es.min_steps
        if branches and es.rule in RUNG_RULES and es.rung_eval == "cooldown":
            out["rung_cooldown.fraction"] = es.cooldown_fraction
            out["rung_cooldown.min_steps"] = es.min_steps
            out["rung_cooldown.eta"] = es.eta
        out.update(self.overrides)
        out.update(params)
        if seed is not None:
            out["seed"] = seed
        return out


def _field(data: Mapping[str, Any], key: str, path: str, kind: type | tuple[type, ...], default: Any) -> Any:
    if key not in data:
        if default is ...:
            raise ValidationError(f"{path}{key}", "is required")
        return default
    value = data[key]
    if kind in (int, float, (int, float)) and isinstance(value, bool):
        raise ValidationError(f"{path}{key}", "must be a number")
    if kind is float and isinstance(value, int):
        value = float(value)
    if not isinstance(value, kind):
        name = kind.__name__ if isinstance(kind, type) else "number"
        raise ValidationError(f"{path}{key}", f"must be a {name}")
    return value


def _number(data: Mapping[str, Any], key: str, path: str, default: Any = ...) -> float:
    value = _field(data, key, path, (int, float), default)
    if not math.isfinite(float(value)):
        raise ValidationError(f"{path}{key}", "must be finite")
    return float(value)


def _check_value(path: str, key_type: str, value: Any) -> Value:
    """A value of a recipe key of type ``key_type`` (from the catalogue)."""
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, int | float) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "str": isinstance(value, str) and len(value) <= 1024,
    }.get(key_type, False)
    if not ok:
        raise ValidationError(path, f"must be a {key_type} (the recipe key's type), got {value!r}")
    if key_type == "float" and not math.isfinite(float(value)):
        raise ValidationError(path, "must be finite")
    return float(value) if key_type == "float" else value  # type: ignore[no-any-return]


def _parameter(key: str, spec: Any, key_type: str, sampler: str) -> Parameter:
    path = f"parameters.{key}"
    if not isinstance(spec, Mapping):
        raise ValidationError(path, "must be a mapping with a type")
    unknown = sorted(set(spec) - {"type", "low", "high", "step", "values", "grid_points"})
    if unknown:
        raise ValidationError(f"{path}.{unknown[0]}", "is not a parameter field")
    kind = _field(spec, "type", path + ".", str, ...)
    if kind not in TYPES:
        raise ValidationError(f"{path}.type", f"must be one of {', '.join(TYPES)}")
    if kind == "categorical":
        values = _field(spec, "values", path + ".", list, ...)
        if not values:
            raise ValidationError(f"{path}.values", "must not be empty")
        if len(values) > MAX_VALUES:
            raise ValidationError(f"{path}.values", f"at most {MAX_VALUES} values")
        checked = tuple(_check_value(f"{path}.values[{i}]", key_type, v) for i, v in enumerate(values))
        if len(set(checked)) != len(checked):
            raise ValidationError(f"{path}.values", "must not repeat a value")
        return Parameter(key, kind, values=checked)
    if kind == "int" and key_type != "int":
        raise ValidationError(f"{path}.type", f"int needs an int recipe key; {key} is {key_type}")
    if kind in ("uniform", "loguniform") and key_type != "float":
        raise ValidationError(f"{path}.type", f"{kind} needs a float recipe key; {key} is {key_type}")
    low, high = _number(spec, "low", path + "."), _number(spec, "high", path + ".")
    if not low < high:
        raise ValidationError(f"{path}.high", f"empty range: high ({high:g}) must exceed low ({low:g})")
    if kind == "loguniform" and low <= 0:
        raise ValidationError(f"{path}.low", "must be > 0 for loguniform")
    if kind == "int":
        if not (low.is_integer() and high.is_integer()):
            raise ValidationError(f"{path}.low", "int bounds must be integers")
        step = int(_number(spec, "step", path + ".", 1))
        if step < 1 or step != _number(spec, "step", path + ".", 1):
            raise ValidationError(f"{path}.step", "must be a positive integer")
        if (high - low) / step + 1 > MAX_VALUES * 4:
            raise ValidationError(f"{path}.step", "the range holds too many values")
        return Parameter(key, kind, low=low, high=high, step=step)
    points = int(_number(spec, "grid_points", path + ".", 0))
    if sampler == "grid" and not 2 <= points <= MAX_VALUES:
        raise ValidationError(
            f"{path}.grid_points", f"a grid needs 2-{MAX_VALUES} points of a continuous range"
        )
    return Parameter(key, kind, low=low, high=high, grid_points=points)


def _early_stopping(data: Any, max_steps: int) -> EarlyStopping:
    if data is None:
        return EarlyStopping()
    if not isinstance(data, Mapping):
        raise ValidationError("early_stopping", "must be a mapping with a rule")
    known = {"rule", "min_steps", "eta", "min_trials", "form", "rung_eval", "cooldown_fraction"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValidationError(f"early_stopping.{unknown[0]}", "is not an early-stopping field")
    rule = _field(data, "rule", "early_stopping.", str, DEFAULT_RULE)
    if rule not in RULES:
        raise ValidationError("early_stopping.rule", f"must be one of {', '.join(RULES)}")
    default_min = 1 if rule == "none" else default_min_steps(max_steps) if rule in GUARDED_RULES else ...
    min_steps = _field(data, "min_steps", "early_stopping.", int, default_min)
    eta = _field(data, "eta", "early_stopping.", int, 3)
    min_trials = _field(data, "min_trials", "early_stopping.", int, 3)
    if rule != "none" and not 1 <= min_steps < max_steps:
        raise ValidationError("early_stopping.min_steps", f"must be in [1, budget.max_steps={max_steps})")
    if not 2 <= eta <= 100:
        raise ValidationError("early_stopping.eta", "must be between 2 and 100")
    if not 1 <= min_trials <= 1000:
        raise ValidationError("early_stopping.min_trials", "must be between 1 and 1000")
    form = _field(data, "form", "early_stopping.", str, "promotion")
    if form not in ASHA_FORMS:
        raise ValidationError("early_stopping.form", f"must be one of {', '.join(ASHA_FORMS)}")
    if form != "promotion" and rule in GUARDED_RULES:
        raise ValidationError(
            "early_stopping.form", f"the {rule} rule pauses trials at rungs (promotion form) only"
        )
    rung_eval = _field(data, "rung_eval", "early_stopping.", str, "auto")
    if rung_eval not in RUNG_EVALS:
        raise ValidationError("early_stopping.rung_eval", f"must be one of {', '.join(RUNG_EVALS)}")
    if rung_eval == "cooldown" and rule not in RUNG_RULES:
        raise ValidationError(
            "early_stopping.rung_eval",
            "cooldown evaluations are taken at the rungs of budgeted, guarded or asha only",
        )
    fraction = _number(data, "cooldown_fraction", "early_stopping.", 0.1)
    if "cooldown_fraction" in data and (rung_eval == "value" or rule not in RUNG_RULES):
        raise ValidationError(
            "early_stopping.cooldown_fraction",
            "applies only with rung_eval: cooldown or auto under budgeted, guarded or asha",
        )
    if not 0.0 < fraction <= 1.0:
        raise ValidationError("early_stopping.cooldown_fraction", "must be in (0, 1]")
    return EarlyStopping(rule, min_steps, eta, min_trials, form, rung_eval, fraction)


def _schedules(entry: Mapping[str, Any], params: list[Parameter], overrides: Mapping[str, Value]) -> set[str]:
    """Every ``optim.schedule`` of the space's trials: swept, else overridden, else the default."""
    for p in params:
        if p.key == "optim.schedule":
            return {str(v) for v in p.grid()}
    if "optim.schedule" in overrides:
        return {str(overrides["optim.schedule"])}
    default = entry["keys"].get("optim.schedule", {}).get("default")
    return {str(default)} if default is not None else set()


def resolve_rung_eval(rule: str, metric: str, key_types: Mapping[str, str], schedules: set[str]) -> str:
    """``rung_eval: auto`` for a space: ``cooldown`` when ASHA judges an evaluation of a recipe
    that takes branches and some trial's schedule is in :data:`HOLD_PEAK_SCHEDULES` (compared at
    their peak rates, larger rates lead: load/sweep/RESULTS.md), else ``value``."""
    if (
        rule in RUNG_RULES
        and "rung_cooldown.fraction" in key_types
        and metric not in _STEP_FIGURES
        and schedules & set(HOLD_PEAK_SCHEDULES)
    ):
        return "cooldown"
    return "value"


def parse(text: str | bytes) -> Space:
    """Parse and validate a space file (YAML or JSON text)."""
    if len(text) > MAX_FILE_BYTES:
        raise ValidationError("space", f"is larger than {MAX_FILE_BYTES} bytes")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValidationError("space", f"is not valid YAML: {exc}") from None
    if not isinstance(data, Mapping):
        raise ValidationError("space", "must be a mapping")
    return from_dict(data)


def from_dict(data: Mapping[str, Any]) -> Space:
    """Validate a decoded space (see the module docstring for the format)."""
    unknown = sorted(set(map(str, data)) - _TOP)
    if unknown:
        raise ValidationError(unknown[0], f"is not a space field (known: {', '.join(sorted(_TOP))})")
    name = _field(data, "name", "", str, ...)
    if not _NAME.match(name):
        raise ValidationError("name", "must be 1-64 letters, digits, '.', '_' or '-'")
    catalog = recipe_catalog()
    recipe = _field(data, "recipe", "", str, ...)
    if recipe not in catalog:
        raise ValidationError("recipe", f"unknown recipe {recipe!r} (known: {', '.join(sorted(catalog))})")
    entry = catalog[recipe]
    key_types: dict[str, str] = {k: v["type"] for k, v in entry["keys"].items()}
    metric = _field(data, "metric", "", dict, ...)
    metric_name = _field(metric, "name", "metric.", str, ...)
    if metric_name not in entry["metrics"]:
        raise ValidationError(
            "metric.name", f"{recipe} does not emit {metric_name!r} (it emits {', '.join(entry['metrics'])})"
        )
    mode = _field(metric, "mode", "metric.", str, "min")
    if mode not in ("min", "max"):
        raise ValidationError("metric.mode", "must be min or max")
    sampler = _field(data, "sampler", "", str, "grid")
    if sampler not in SAMPLERS:
        raise ValidationError("sampler", f"must be one of {', '.join(SAMPLERS)}")
    raw_params = _field(data, "parameters", "", dict, ...)
    if not raw_params:
        raise ValidationError("parameters", "must name at least one recipe key")
    if len(raw_params) > MAX_PARAMETERS:
        raise ValidationError("parameters", f"at most {MAX_PARAMETERS} parameters")
    params: list[Parameter] = []
    for key, spec in raw_params.items():
        key = str(key)
        if key in ("seed", "max_steps") or not _KEY.match(key) or key not in key_types:
            raise ValidationError(
                f"parameters.{key[:80]}",
                f"unknown parameter: not an override key of {recipe}"
                + (" (seed comes from seeds, max_steps from budget)" if key in ("seed", "max_steps") else ""),
            )
        params.append(_parameter(key, spec, key_types[key], sampler))
    overrides: dict[str, Value] = {}
    for key, value in _field(data, "overrides", "", dict, {}).items():
        key = str(key)
        if key not in key_types or key in raw_params or key in ("seed", "max_steps"):
            raise ValidationError(f"overrides.{key[:80]}", f"unknown or swept override key of {recipe}")
        overrides[key] = _check_value(f"overrides.{key}", key_types[key], value)
    budget = _field(data, "budget", "", dict, ...)
    unknown = sorted(set(budget) - {"trials", "gpu_hours", "max_steps"})
    if unknown:
        raise ValidationError(f"budget.{unknown[0]}", "is not a budget field (trials, gpu_hours, max_steps)")
    trials = _field(budget, "trials", "budget.", int, ...)
    if not 1 <= trials <= MAX_TRIALS:
        raise ValidationError("budget.trials", f"must be between 1 and {MAX_TRIALS}")
    gpu_hours = _number(budget, "gpu_hours", "budget.")
    if not 0 < gpu_hours <= 1e6:
        raise ValidationError("budget.gpu_hours", "must be > 0")
    max_steps = _field(budget, "max_steps", "budget.", int, ...)
    if not 1 <= max_steps <= 10_000_000:
        raise ValidationError("budget.max_steps", "must be between 1 and 10000000")
    seeds_raw = _field(data, "seeds", "", list, [])
    if len(seeds_raw) > MAX_SEEDS:
        raise ValidationError("seeds", f"at most {MAX_SEEDS} seeds")
    seeds = tuple(int(_check_value(f"seeds[{i}]", "int", s)) for i, s in enumerate(seeds_raw))
    if len(set(seeds)) != len(seeds):
        raise ValidationError("seeds", "must not repeat a seed")
    baseline: dict[str, Value] = {}
    for key, value in _field(data, "baseline", "", dict, {}).items():
        if str(key) not in raw_params:
            raise ValidationError(f"baseline.{str(key)[:80]}", "must be a swept parameter")
        baseline[str(key)] = _check_value(f"baseline.{key}", key_types[str(key)], value)
    if baseline and set(baseline) != set(raw_params):
        missing = sorted(set(raw_params) - set(baseline))[0]
        raise ValidationError(f"baseline.{missing}", "the baseline names a value for every parameter")
    early = _early_stopping(data.get("early_stopping"), max_steps)
    if early.rung_eval == "auto":
        resolved = resolve_rung_eval(early.rule, metric_name, key_types, _schedules(entry, params, overrides))
        early = replace(early, rung_eval=resolved)
    if early.rung_eval == "cooldown":
        if "rung_cooldown.fraction" not in key_types:
            raise ValidationError("early_stopping.rung_eval", f"{recipe} takes no cooldown branches")
        if metric_name in _STEP_FIGURES:
            raise ValidationError(
                "early_stopping.rung_eval",
                f"{metric_name} is a training figure, not an evaluation a branch reports",
            )
        for where, keys in (("parameters", raw_params), ("overrides", overrides)):
            taken = sorted(str(k) for k in keys if str(k).startswith("rung_cooldown."))
            if taken:
                raise ValidationError(f"{where}.{taken[0]}", "is set by early_stopping.rung_eval")
    eval_every = overrides.get("eval_interval")
    if early.rule != "none" and isinstance(eval_every, int) and early.min_steps % eval_every:
        raise ValidationError("overrides.eval_interval", "must divide early_stopping.min_steps")
    team = _field(data, "team", "", str, "")
    if team and not _TEAM.match(team):
        raise ValidationError("team", "must be 1-128 letters, digits, '.', '_' or '-'")
    priority = _field(data, "priority_class", "", str, "preemptible")
    if not _NAME.match(priority):
        raise ValidationError("priority_class", "must be a priority class name")
    space = Space(
        name=name,
        recipe=recipe,
        metric=metric_name,
        mode=mode,
        sampler=sampler,
        parameters=tuple(params),
        trials=trials,
        gpu_hours=gpu_hours,
        max_steps=max_steps,
        overrides=overrides,
        seeds=seeds,
        baseline=baseline,
        seed=_field(data, "seed", "", int, 0),
        concurrency=_field(data, "concurrency", "", int, 4),
        team=team,
        priority_class=priority,
        gpus_per_trial=_field(data, "gpus_per_trial", "", int, 1),
        gpu_type=_field(data, "gpu_type", "", str, ...),
        early_stopping=early,
        trial_timeout_s=_number(data, "trial_timeout_s", "", 6 * 3600.0),
        metrics_timeout_s=_number(data, "metrics_timeout_s", "", 1800.0),
    )
    if not 1 <= space.concurrency <= 256:
        raise ValidationError("concurrency", "must be between 1 and 256")
    if not 1 <= space.gpus_per_trial <= 64:
        raise ValidationError("gpus_per_trial", "must be between 1 and 64 (a training job asks for a device)")
    if not _NAME.match(space.gpu_type):
        raise ValidationError("gpu_type", "must be a device type name (letters, digits, '.', '_', '-')")
    if not 1 <= space.trial_timeout_s <= 30 * 86400:
        raise ValidationError("trial_timeout_s", "must be between 1 and 2592000")
    if not 1 <= space.metrics_timeout_s <= 86400:
        raise ValidationError("metrics_timeout_s", "must be between 1 and 86400")
    cadence = overrides.get("eval_interval") or (
        early.min_steps if early.rule != "none" else entry["keys"].get("eval_interval", {}).get("default", 1)
    )
    reports = math.ceil(max_steps / max(1, int(cadence))) + 1
    if trials * (reports + EVENTS_PER_TRIAL) > MAX_HISTORY_EVENTS:
        raise ValidationError(
            "budget.trials",
            f"{trials} trials reporting {space.metric} {reports} times each would outgrow the sweep's "
            f"history (at most {MAX_HISTORY_EVENTS} events): fewer trials or a longer eval_interval",
        )
    if sampler == "grid":
        size = math.prod(len(p.grid()) for p in params) * max(1, len(seeds))
        if size > trials:
            raise ValidationError(
                "budget.trials",
                f"the grid has {size} trials (configurations x seeds); budget.trials is {trials}",
            )
    if baseline and sampler == "grid" and baseline not in space.grid():
        raise ValidationError("baseline", "is not a configuration of the grid")
    return space


def to_dict(space: Space) -> dict[str, Any]:
    """The space as the JSON-able mapping :func:`from_dict` reads back."""
    params: dict[str, Any] = {}
    for p in space.parameters:
        spec: dict[str, Any] = {"type": p.type}
        if p.type == "categorical":
            spec["values"] = list(p.values)
        else:
            spec.update(low=p.low, high=p.high)
            if p.type == "int":
                spec.update(low=int(p.low), high=int(p.high), step=p.step)
            elif p.grid_points:
                spec["grid_points"] = p.grid_points
        params[p.key] = spec
    es = space.early_stopping
    return {
        "name": space.name,
        "recipe": space.recipe,
        "metric": {"name": space.metric, "mode": space.mode},
        "sampler": space.sampler,
        "seed": space.seed,
        "parameters": params,
        "overrides": dict(space.overrides),
        "seeds": list(space.seeds),
        "baseline": dict(space.baseline),
        "budget": {"trials": space.trials, "gpu_hours": space.gpu_hours, "max_steps": space.max_steps},
        "concurrency": space.concurrency,
        "team": space.team,
        "priority_class": space.priority_class,
        "gpus_per_trial": space.gpus_per_trial,
        "gpu_type": space.gpu_type,
        "early_stopping": {
            "rule": es.rule,
            "min_steps": es.min_steps,
            "eta": es.eta,
            "min_trials": es.min_trials,
            "form": es.form,
            # the resolved choice, never ``auto``: a reloaded space judges rungs as it did
            "rung_eval": es.rung_eval,
            **({"cooldown_fraction": es.cooldown_fraction} if es.rung_eval == "cooldown" else {}),
        },
        "trial_timeout_s": space.trial_timeout_s,
        "metrics_timeout_s": space.metrics_timeout_s,
    }
