"""What every scenario records: latencies, outcomes per time window, and resident memory."""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from forge_kit.stats import percentile


def percentile_ms(values: list[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` (seconds) in milliseconds; NaN when there are none."""
    return percentile(values, q, empty=math.nan) * 1000


def rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` and its children (torchrun, worker threads share it) in MiB,
    read from ``/proc``; 0 when the process is gone."""
    total = 0
    for p in (pid, *_children(pid)):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except (OSError, ValueError):
            continue
    return total / 1024


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        tasks = Path(f"/proc/{pid}/task").iterdir()
        for task in tasks:
            raw = (task / "children").read_text().split()
            for child in map(int, raw):
                found.extend((child, *_children(child)))
    except (OSError, ValueError):
        pass
    return found


@dataclass
class Tally:
    """Latencies per operation and outcomes per window of ``window_s`` seconds since ``start``."""

    window_s: float = 60.0
    start: float = field(default_factory=time.monotonic)
    latencies: dict[str, list[float]] = field(default_factory=dict)
    ok: Counter[int] = field(default_factory=Counter)
    errors: Counter[int] = field(default_factory=Counter)
    error_kinds: Counter[str] = field(default_factory=Counter)

    def record(self, op: str, seconds: float, error: str | None = None) -> None:
        window = int((time.monotonic() - self.start) // self.window_s)
        if error is None:
            self.latencies.setdefault(op, []).append(seconds)
            self.ok[window] += 1
        else:
            self.errors[window] += 1
            self.error_kinds[f"{op}: {error}"] += 1

    @property
    def completed(self) -> int:
        return sum(self.ok.values())

    @property
    def failed(self) -> int:
        return sum(self.errors.values())

    def summary(self) -> dict[str, object]:
        ops = {
            op: {
                "count": len(values),
                "p50_ms": percentile_ms(values, 50),
                "p95_ms": percentile_ms(values, 95),
                "p99_ms": percentile_ms(values, 99),
            }
            for op, values in sorted(self.latencies.items())
        }
        return {
            "completed": self.completed,
            "failed": self.failed,
            "error_rate": self.failed / max(1, self.completed + self.failed),
            "errors": dict(self.error_kinds.most_common(10)),
            "ops": ops,
        }

    def error_rates(self) -> list[float]:
        """Error rate per window, in window order."""
        last = max([*self.ok, *self.errors], default=-1)
        return [self.errors[w] / max(1, self.ok[w] + self.errors[w]) for w in range(last + 1)]
