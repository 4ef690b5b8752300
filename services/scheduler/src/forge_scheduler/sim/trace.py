"""Reading job traces: the generic CSV of the benchmark contract and the Philly (Pollux) file.

Everything is validated before anything is written: a bad row stops the run with the row number
and the field.
"""

from __future__ import annotations

import csv
import datetime as dt
import math
from dataclasses import dataclass
from pathlib import Path

from forge_scheduler.policy.model import Priority


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the row and field."""


@dataclass(frozen=True)
class TraceJob:
    """One trace row. ``duration_s`` is ground truth for the simulator only, never for the policy."""

    id: str
    submit_time: float
    duration_s: float
    num_gpus: int
    team: str
    priority: Priority = Priority.NORMAL


def _time(value: str, row: int, field: str) -> float:
    try:
        return float(value)
    except ValueError:
        pass
    try:
        stamp = dt.datetime.fromisoformat(value.strip())
    except ValueError:
        raise TraceError(f"row {row}: {field}: neither seconds nor an ISO time: {value!r}") from None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=dt.UTC)
    return stamp.timestamp()


def _positive(value: str, row: int, field: str, integer: bool) -> float:
    try:
        number = float(value)
    except ValueError:
        raise TraceError(f"row {row}: {field}: not a number: {value!r}") from None
    if not math.isfinite(number) or number <= 0:
        raise TraceError(f"row {row}: {field}: must be positive, got {value!r}")
    if integer and number != int(number):
        raise TraceError(f"row {row}: {field}: must be a whole number, got {value!r}")
    return number


def load_trace(path: Path, fmt: str = "generic") -> list[TraceJob]:
    """Rows sorted by submit time, times shifted so the first submit is 0."""
    columns = {
        "generic": ("submit_time", "duration_s", "num_gpus", "team"),
        "philly": ("timestamp", "duration", "num_gpus", "cluster"),
    }
    if fmt not in columns:
        raise TraceError(f"format: unknown {fmt!r}; expected one of {sorted(columns)}")
    submit_col, duration_col, gpus_col, team_col = columns[fmt]
    try:
        handle = path.open(newline="")
    except OSError as exc:
        raise TraceError(f"trace: cannot read {path}: {exc.strerror}") from None
    jobs: list[TraceJob] = []
    with handle:
        reader = csv.DictReader(handle)
        missing = [
            c for c in (submit_col, duration_col, gpus_col, team_col) if c not in (reader.fieldnames or [])
        ]
        if missing:
            raise TraceError(f"trace: missing column(s) {', '.join(missing)} (format {fmt})")
        has_priority = "priority" in (reader.fieldnames or [])
        for row_no, row in enumerate(reader, start=2):
            team = (row[team_col] or "").strip()
            if not team:
                raise TraceError(f"row {row_no}: {team_col}: empty")
            priority = Priority.NORMAL
            if has_priority and (row["priority"] or "").strip():
                try:
                    priority = Priority.parse(row["priority"])
                except ValueError as exc:
                    raise TraceError(f"row {row_no}: {exc}") from None
            jobs.append(
                TraceJob(
                    id=f"j{row_no - 1:06d}",
                    submit_time=_time(row[submit_col], row_no, submit_col),
                    duration_s=_positive(row[duration_col], row_no, duration_col, integer=False),
                    num_gpus=int(_positive(row[gpus_col], row_no, gpus_col, integer=True)),
                    team=team,
                    priority=priority,
                )
            )
    if not jobs:
        raise TraceError("trace: no rows")
    start = min(j.submit_time for j in jobs)
    jobs = [TraceJob(j.id, j.submit_time - start, j.duration_s, j.num_gpus, j.team, j.priority) for j in jobs]
    jobs.sort(key=lambda j: (j.submit_time, j.id))
    return jobs
