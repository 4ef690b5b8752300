"""What this node is: its name, its GPUs and where it sits in the network.

GPUs come from ``nvidia-smi`` when it is installed, or from the ``gpus`` setting, which describes
simulated GPUs (tests, CPU-only clusters) and overrides detection when set.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field

import structlog
from forge.common.v1 import common_pb2
from forge.scheduler.v1 import scheduler_pb2

from forge_trainer_agent.sandbox import JobIsolation

log = structlog.get_logger(__name__)

#: The query the agent runs; ``parse_nvidia_smi`` reads its output.
NVIDIA_SMI_QUERY = ["--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"]

MAX_GPUS_PER_ENTRY = 256
_VENDOR_WORDS = {"NVIDIA", "TESLA", "GEFORCE", "QUADRO"}
_SERIES_WORDS = {"RTX", "GTX"}
_SPEC_ENTRY = re.compile(r"^(?P<type>[A-Za-z0-9._-]+?)(?:x(?P<count>\d+))?(?::(?P<memory>\d+))?$")


@dataclass(frozen=True)
class GpuInfo:
    """One GPU of the node."""

    index: int
    type: str
    memory_mb: int

    def to_proto(self) -> common_pb2.Gpu:
        return common_pb2.Gpu(index=self.index, type=self.type, memory_mb=self.memory_mb)


@dataclass(frozen=True)
class NodeInfo:
    """The node as the agent announces it in ``RegisterNode``."""

    name: str
    gpus: tuple[GpuInfo, ...] = ()
    node_group: str = ""
    rack: str = ""
    nvlink_domain: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    isolation: JobIsolation | None = None
    """How jobs run here (checked at start-up); None when the caller chose the runner itself."""

    def topology(self) -> scheduler_pb2.NodeTopology:
        return scheduler_pb2.NodeTopology(
            node_group=self.node_group, rack=self.rack, nvlink_domain=self.nvlink_domain
        )


class GpuSpecError(ValueError):
    """A GPU description (setting or nvidia-smi output) that cannot be read."""


def gpu_type_from_name(name: str) -> str:
    """The scheduler's GPU type for a marketing name: ``NVIDIA H100 80GB HBM3`` → ``H100``,
    ``NVIDIA A100-SXM4-80GB`` → ``A100``, ``NVIDIA GeForce RTX 4090`` → ``RTX-4090``."""
    words = [w for w in name.replace("(", " ").replace(")", " ").split() if w.upper() not in _VENDOR_WORDS]
    for i, word in enumerate(words):
        if word.upper() in _SERIES_WORDS and i + 1 < len(words):
            return f"{word.upper()}-{words[i + 1].split('-')[0]}"
        if any(c.isdigit() for c in word):
            return word.split("-")[0]
    if not words:
        raise GpuSpecError(f"GPU name {name!r} names no model")
    return words[0]


def parse_nvidia_smi(output: str) -> tuple[GpuInfo, ...]:
    """Read the output of ``nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader,nounits``.

    Each line is ``<index>, <name>, <memory MiB>``; memory may be ``[N/A]`` (reported as 0).
    A line that is not in this form is an error rather than a GPU silently left out.
    """
    gpus = []
    for number, raw in enumerate(output.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            raise GpuSpecError(
                f"nvidia-smi line {number}: expected 'index, name, memory.total', got {line!r}"
            )
        index, name, memory = parts
        if not index.isdigit():
            raise GpuSpecError(f"nvidia-smi line {number}: index {index!r} is not a number")
        memory_mb = int(memory) if memory.isdigit() else 0
        gpus.append(GpuInfo(index=int(index), type=gpu_type_from_name(name), memory_mb=memory_mb))
    indices = [g.index for g in gpus]
    if len(set(indices)) != len(indices):
        raise GpuSpecError(f"nvidia-smi reported an index twice: {indices}")
    return tuple(sorted(gpus, key=lambda g: g.index))


def parse_gpu_spec(spec: str) -> tuple[GpuInfo, ...]:
    """Read the ``gpus`` setting: comma-separated ``TYPE[xCOUNT][:MEMORY_MB]`` entries, numbered
    from 0 in order, e.g. ``H100x8:81559`` or ``A100-80GBx4,L4x2``.

    The count is the digits after the last lowercase ``x``; a type that itself ends in
    ``x<digits>`` must carry an explicit count (``Ax100x1``).
    """
    gpus: list[GpuInfo] = []
    for raw in spec.split(","):
        entry = raw.strip()
        if not entry:
            continue
        match = _SPEC_ENTRY.match(entry)
        if match is None:
            raise GpuSpecError(f"entry {entry!r} is not TYPE[xCOUNT][:MEMORY_MB]")
        count = int(match["count"]) if match["count"] else 1
        if not 1 <= count <= MAX_GPUS_PER_ENTRY:
            raise GpuSpecError(f"entry {entry!r}: count must be between 1 and {MAX_GPUS_PER_ENTRY}")
        memory_mb = int(match["memory"]) if match["memory"] else 0
        first = len(gpus)
        gpus.extend(GpuInfo(index=first + i, type=match["type"], memory_mb=memory_mb) for i in range(count))
    return tuple(gpus)


def detect_gpus(nvidia_smi: str = "nvidia-smi", timeout_s: float = 10.0) -> tuple[GpuInfo, ...]:
    """The GPUs ``nvidia-smi`` reports; none when it is missing or cannot talk to a driver."""
    binary = shutil.which(nvidia_smi)
    if binary is None:
        return ()
    try:
        done = subprocess.run(
            [binary, *NVIDIA_SMI_QUERY], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("node.nvidia_smi_failed", error=str(exc))
        return ()
    if done.returncode != 0:
        log.warning("node.nvidia_smi_failed", exit_code=done.returncode, stderr=done.stderr.strip()[-500:])
        return ()
    return parse_nvidia_smi(done.stdout)
