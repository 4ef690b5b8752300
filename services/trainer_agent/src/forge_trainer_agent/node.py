"""What this node is: its name, its GPUs and where it sits in the network.

GPUs come from NVML or ``torch.cuda`` (``forge_trainer_agent.gpus``), or from the ``gpus`` setting,
which describes simulated GPUs (tests, CPU-only clusters) and overrides detection when set.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from forge.common.v1 import common_pb2
from forge.scheduler.v1 import scheduler_pb2

from forge_trainer_agent.sandbox import JobIsolation

#: The node label the scheduler reads a node's address from (a multi-node job's MASTER_ADDR).
ADDRESS_LABEL = "forge.ai/address"
EVENT_LOG_LABEL = "forge.ai/event-log"
"""Node label: host:port of the agent's gRPC server, where consumers read its outbox
(``EventLogService``) for events the broker lost."""
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
    uuid: str = ""
    pci_bus_id: str = ""
    nvlink_group: int = 0
    """GPUs of the node with the same non-zero group reach each other over NVLink; 0: no peer."""
    pcie_group: int = 0
    """GPUs of the node with the same non-zero group share a PCIe host bridge; 0: unknown."""

    def to_proto(self) -> common_pb2.Gpu:
        return common_pb2.Gpu(
            index=self.index,
            type=self.type,
            memory_mb=self.memory_mb,
            uuid=self.uuid,
            pci_bus_id=self.pci_bus_id,
            nvlink_group=self.nvlink_group,
            pcie_group=self.pcie_group,
        )


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
    """A GPU description (the ``gpus`` setting, a device name) that cannot be read."""


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
