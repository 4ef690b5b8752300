"""The platform's main job: the steps that service packages register, run in a fixed order.

``forge up`` ends by running the main job so that "the platform is up" means "it did real work
across every layer", not "every port answers". Each capability adds its own step without touching
the CLI, through the entry-point group ``forge.main_job``::

    [project.entry-points."forge.main_job"]
    smoke = "forge_orchestrator.mainjob:step"

The contract of a step:

- ``async def step(ctx) -> dict[str, object]``; ``ctx`` is a :class:`MainJobContext`;
- optional attributes on the callable: ``order`` (int, default 100; lower runs first, ties by
  entry-point name) and ``timeout_s`` (float, default 300);
- it fails by raising, or by returning a dict with ``"ok": False``; the first failure stops the job;
- the dict it returns is printed as a table and is visible to later steps in ``ctx.results``.

Service packages must not import this module (services never depend on the CLI): annotate ``ctx``
with a local ``Protocol`` or ``Any`` and use the attributes documented on :class:`MainJobContext`.
"""

from __future__ import annotations

import asyncio
import json
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

GROUP = "forge.main_job"
DEFAULT_ORDER = 100
DEFAULT_TIMEOUT_S = 300.0

StepFn = Callable[[Any], Awaitable[Mapping[str, Any]]]


@dataclass(frozen=True)
class ServiceEndpoint:
    """How to reach one running service."""

    name: str
    grpc_target: str
    """``host:port`` of its gRPC server."""
    http_url: str
    """``http://host:port`` of its HTTP server."""
    token: str
    """Bearer token it accepts (gRPC metadata ``authorization: Bearer <token>`` or HTTP header)."""


@dataclass(frozen=True)
class MainJobContext:
    """What every step gets: addresses and tokens of the platform ``forge up`` started."""

    root: Path
    """Repository root; local state is under ``root / "var"``."""
    services: Mapping[str, ServiceEndpoint]
    """Every service in the platform table, by name (``"scheduler"``, ``"orchestrator"``, …)."""
    kafka_bootstrap: str
    temporal_target: str
    temporal_namespace: str
    object_store_url: str
    mlflow_url: str = ""
    """The MLflow tracking server (and UI) every training run is recorded in."""
    results: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    """Results of the steps that already ran, by step name."""
    database_urls: Mapping[str, str] = field(default_factory=dict)
    """Services whose database is a server (``forge up --profile prod-like``), by name: a step
    that seeds a service's store directly uses this URL; a service not listed keeps SQLite in
    its data folder."""

    def endpoint(self, name: str) -> ServiceEndpoint:
        """The endpoint of service ``name``; a clear error when the platform has no such service."""
        try:
            return self.services[name]
        except KeyError:
            raise KeyError(
                f"service {name!r} is not part of the platform ({', '.join(self.services)})"
            ) from None


@dataclass(frozen=True)
class Step:
    name: str
    fn: StepFn
    order: int
    timeout_s: float


@dataclass
class StepOutcome:
    name: str
    ok: bool
    seconds: float
    result: Mapping[str, Any] = field(default_factory=dict)
    error: str = ""


def _broken(message: str) -> StepFn:
    async def fail(_ctx: Any) -> Mapping[str, Any]:
        raise RuntimeError(message)

    return fail


def discover(group: str = GROUP) -> list[Step]:
    """Registered steps in run order. A step that fails to import stays in, as a failing step."""
    steps = []
    for ep in entry_points(group=group):
        try:
            fn = ep.load()
        except Exception as exc:  # noqa: BLE001 - reported as this step's failure
            steps.append(Step(ep.name, _broken(f"cannot load {ep.value}: {exc!r}"), DEFAULT_ORDER, 1.0))
            continue
        order = getattr(fn, "order", DEFAULT_ORDER)
        timeout_s = getattr(fn, "timeout_s", DEFAULT_TIMEOUT_S)
        steps.append(Step(ep.name, fn, int(order), float(timeout_s)))
    return sorted(steps, key=lambda s: (s.order, s.name))


async def _run_one(step: Step, ctx: MainJobContext) -> StepOutcome:
    started = time.monotonic()
    try:
        result = await asyncio.wait_for(step.fn(ctx), timeout=step.timeout_s)
    except TimeoutError:
        return StepOutcome(
            step.name, False, time.monotonic() - started, error=f"timed out after {step.timeout_s}s"
        )
    except Exception as exc:  # noqa: BLE001 - a step's failure is reported, not raised
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        return StepOutcome(step.name, False, time.monotonic() - started, error=detail)
    elapsed = time.monotonic() - started
    if not isinstance(result, Mapping):
        return StepOutcome(step.name, False, elapsed, error=f"returned {type(result).__name__}, not a dict")
    ok = result.get("ok", True) is not False
    return StepOutcome(step.name, ok, elapsed, result=result, error="" if ok else "step reported ok=False")


async def run(steps: list[Step], ctx: MainJobContext, console: Console) -> list[StepOutcome]:
    """Run ``steps`` in order with a progress display; stop at the first failure."""
    outcomes: list[StepOutcome] = []
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        for index, step in enumerate(steps, start=1):
            task = progress.add_task(f"[{index}/{len(steps)}] {step.name}", total=1)
            outcome = await _run_one(step, ctx)
            outcomes.append(outcome)
            mark = "[green]ok[/]" if outcome.ok else "[red]FAILED[/]"
            progress.update(task, completed=1, description=f"[{index}/{len(steps)}] {step.name} {mark}")
            if not outcome.ok:
                break
            ctx.results[step.name] = outcome.result
    return outcomes


def _cell(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, default=str)
    except (TypeError, ValueError):
        return repr(value)


def render(outcome: StepOutcome) -> Table:
    """One step's result dict (or its error) as a two-column table."""
    status = "[green]ok[/]" if outcome.ok else "[red]failed[/]"
    table = Table(
        title=f"main job step {outcome.name}: {status} in {outcome.seconds:.1f}s", title_justify="left"
    )
    table.add_column("key", style="bold")
    table.add_column("value", overflow="fold")
    for key, value in outcome.result.items():
        table.add_row(str(key), _cell(value))
    if outcome.error:
        table.add_row("[red]error[/]", outcome.error)
    return table
