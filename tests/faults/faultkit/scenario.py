"""Fault scenarios declared in YAML (``tests/faults/scenarios.yaml``): what, where, when, how long.

.. code-block:: yaml

    broker_partition:
      description: the broker unreachable from its producers
      faults:
        - {fault: partition, target: broker, direction: both, at_s: 2, for_s: 15}
        - {fault: kill, target: feedback, at_s: 8}

A scenario is a list of faults, each on a named ``target`` the test provides (a
:class:`~forge_kit.testing.fault_proxy.FaultProxy` link, or a :class:`Process` for ``pause``/``kill``, or a
:class:`~faultkit.host.SizedMount` for ``disk_full``), starting ``at_s`` seconds after the
scenario starts and healed ``for_s`` later (``kill`` is instantaneous: the test's ``restart``
brings the process back ``for_s`` later, if given). ``clock_skew`` (``offset_s``) is applied
when the target process starts (:func:`clock_env`), so it is declared at ``at_s: 0`` and lasts
the whole scenario. :func:`run_timeline` plays the rest and records when each began and healed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from forge_kit.testing.fault_proxy import FaultProxy

from .host import SizedMount, pause, resume, skewed_clock_env

SCENARIOS = Path(__file__).resolve().parent.parent / "scenarios.yaml"
FaultKind = Literal[
    "partition", "latency", "loss", "bandwidth", "reset", "pause", "kill", "disk_full", "clock_skew"
]
LINK_FAULTS = {"partition", "latency", "loss", "bandwidth", "reset"}


class Fault(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fault: FaultKind
    target: str = Field(min_length=1, max_length=64)
    at_s: float = Field(ge=0, le=3600)
    for_s: float | None = Field(default=None, gt=0, le=3600)
    direction: Literal["up", "down", "both"] = "both"
    latency_s: float = Field(default=0.0, ge=0, le=60)
    jitter_s: float = Field(default=0.0, ge=0, le=60)
    loss: float = Field(default=0.0, ge=0, lt=1)
    reset: float = Field(default=0.0, ge=0, le=1)
    bandwidth_bps: int = Field(default=0, ge=0)
    reset_on_heal: bool = False  # partition: cut the held connections when it heals
    offset_s: float = Field(default=0.0, ge=-86400, le=86400)  # clock_skew
    free_bytes: int = Field(default=0, ge=0)  # disk_full: left free, so a large write fills it midway

    @model_validator(mode="after")
    def _complete(self) -> Fault:
        if self.fault == "clock_skew":
            if self.offset_s == 0 or self.at_s != 0:
                raise ValueError("a clock_skew fault needs offset_s and at_s 0 (set when the process starts)")
            return self
        if self.fault != "kill" and self.for_s is None:
            raise ValueError(f"a {self.fault} fault needs for_s (how long it lasts)")
        if self.fault == "latency" and self.latency_s == 0:
            raise ValueError("a latency fault needs latency_s")
        if self.fault == "loss" and self.loss == 0:
            raise ValueError("a loss fault needs loss")
        if self.fault == "bandwidth" and self.bandwidth_bps == 0:
            raise ValueError("a bandwidth fault needs bandwidth_bps")
        if self.fault == "reset" and self.reset == 0:
            raise ValueError("a reset fault needs reset")
        return self

    def link_settings(self) -> dict[str, object]:
        if self.fault == "partition":
            return {"blackhole": self.direction}
        settings: dict[str, object] = {}
        if self.latency_s or self.fault == "latency":
            settings.update(latency_s=self.latency_s, jitter_s=self.jitter_s)
        if self.loss:
            settings["loss"] = self.loss
        if self.reset:
            settings["reset"] = self.reset
        if self.bandwidth_bps:
            settings["bandwidth_bps"] = self.bandwidth_bps
        return settings


class Scenario(BaseModel):
    model_config = ConfigDict(extra="forbid")

    description: str = Field(min_length=1, max_length=500)
    faults: list[Fault] = Field(min_length=1, max_length=32)

    @property
    def duration_s(self) -> float:
        return max(f.at_s + (f.for_s or 0.0) for f in self.faults)


def clock_env(scenario: Scenario, target: str) -> dict[str, str]:
    """The environment that starts ``target`` with the scenario's clock skew (empty if none)."""
    skews = [f.offset_s for f in scenario.faults if f.fault == "clock_skew" and f.target == target]
    return skewed_clock_env(skews[0]) if skews else {}


def load_scenarios(path: Path = SCENARIOS) -> dict[str, Scenario]:
    raw = yaml.safe_load(path.read_text())
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{path}: a mapping of scenario names to scenarios")
    return {str(name): Scenario.model_validate(body) for name, body in raw.items()}


def load_scenario(name: str, path: Path = SCENARIOS) -> Scenario:
    scenarios = load_scenarios(path)
    if name not in scenarios:
        raise KeyError(f"no scenario {name!r} in {path} (there are {sorted(scenarios)})")
    return scenarios[name]


class Process(Protocol):
    """A process target: what ``pause`` needs of it (the leader of its process group)."""

    @property
    def pid(self) -> int | None: ...


@dataclass
class Targets:
    links: Mapping[str, FaultProxy]
    processes: Mapping[str, Process] | None = None
    mounts: Mapping[str, SizedMount] | None = None
    kill: Callable[[str], None] | None = None  # kills a process target (blocking)
    restart: Callable[[str], None] | None = None  # starts it again in place (blocking)


@dataclass(frozen=True)
class Applied:
    fault: Fault
    began_s: float
    healed_s: float | None


def _check_targets(scenario: Scenario, targets: Targets) -> None:
    for fault in scenario.faults:
        if fault.fault == "clock_skew":
            continue
        pool: Mapping[str, object] | None
        if fault.fault in LINK_FAULTS:
            pool = targets.links
        elif fault.fault == "disk_full":
            pool = targets.mounts
        else:
            pool = targets.processes
        if not pool or fault.target not in pool:
            raise KeyError(f"{fault.fault} fault on {fault.target!r}: the test gave no such target")
        if fault.fault == "kill" and (targets.kill is None or (fault.for_s and targets.restart is None)):
            raise ValueError("a kill fault needs Targets.kill (and restart when for_s is set)")


async def run_timeline(scenario: Scenario, targets: Targets) -> list[Applied]:
    """Play the scenario's faults at their times; returns when each began and healed (seconds
    from the start). Every fault is healed before this returns, even on error or cancellation."""
    _check_targets(scenario, targets)
    start = time.monotonic()

    def now() -> float:
        return time.monotonic() - start

    async def at(t: float) -> None:
        await asyncio.sleep(max(0.0, t - now()))

    async def one(fault: Fault) -> Applied:
        await at(fault.at_s)
        began = now()
        heal: Callable[[], None] | None = None
        if fault.fault in LINK_FAULTS:
            link = targets.links[fault.target]
            link.configure(**fault.link_settings())
            heal = lambda: link.heal(reset=fault.reset_on_heal)  # noqa: E731
        elif fault.fault == "disk_full":
            mount = (targets.mounts or {})[fault.target]
            await asyncio.to_thread(mount.fill, fault.free_bytes)
            heal = mount.drain
        elif fault.fault == "pause":
            pid = (targets.processes or {})[fault.target].pid
            assert pid is not None, f"{fault.target} is not running"
            pause(pid)
            heal = lambda: resume(pid)  # noqa: E731
        else:  # kill
            assert targets.kill is not None
            await asyncio.to_thread(targets.kill, fault.target)
            if fault.for_s and targets.restart is not None:
                restart = targets.restart
                heal = lambda: restart(fault.target)  # noqa: E731
        if heal is None or fault.for_s is None:
            return Applied(fault, began, None)
        try:
            await at(fault.at_s + fault.for_s)
        finally:
            await asyncio.to_thread(heal)
        return Applied(fault, began, now())

    timed = [f for f in scenario.faults if f.fault != "clock_skew"]
    return list(await asyncio.gather(*(one(f) for f in timed)))
