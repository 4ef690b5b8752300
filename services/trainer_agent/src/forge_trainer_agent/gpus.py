"""Which GPUs this node has: NVML first (``nvidia-ml-py``), ``torch.cuda`` when NVML is missing.

NVML gives each device's name, memory, UUID and PCI bus id, and the node's topology: which GPUs
reach each other over NVLink (directly or through NVSwitch: NVML's P2P status for the NVLink
capability) and which sit under one PCIe host bridge (NVML's common ancestor at most
``HOSTBRIDGE``). Both relations become numbered groups on each :class:`GpuInfo` (connected
components, numbered from 1 in device order) that the agent registers with the scheduler.

NVML numbers devices in PCI bus order; jobs get ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so the CUDA
ordinals in their ``CUDA_VISIBLE_DEVICES`` are the same devices (``runner.job_environment``).

``torch.cuda`` (no topology) is the fallback for hosts where the NVML library cannot be loaded but
CUDA can. The ``gpus`` setting (simulated GPUs) overrides both: :func:`node_gpus`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from forge_trainer_agent.node import GpuInfo, gpu_type_from_name, parse_gpu_spec

log = structlog.get_logger(__name__)

MIB = 1024 * 1024


@dataclass(frozen=True)
class Detected:
    """What the node reports and where it came from: ``setting``, ``nvml``, ``torch`` or ``none``."""

    gpus: tuple[GpuInfo, ...]
    source: str


def node_gpus(setting: str) -> Detected:
    """The ``gpus`` setting when set (it overrides detection), else :func:`detect_gpus`."""
    if setting.strip():
        return Detected(parse_gpu_spec(setting), "setting")
    return detect_gpus()


def detect_gpus() -> Detected:
    """NVML's view of the node; ``torch.cuda``'s when NVML cannot be used; none without either."""
    found = detect_nvml()
    if found is not None:
        return Detected(found, "nvml")
    found = detect_torch()
    if found is not None:
        return Detected(found, "torch")
    return Detected((), "none")


def _text(value: str | bytes) -> str:
    """NVML strings: ``str`` in current bindings, ``bytes`` in older ones."""
    return value.decode() if isinstance(value, bytes) else value


def detect_nvml() -> tuple[GpuInfo, ...] | None:
    """The GPUs NVML reports, with their topology groups; None when NVML is unusable here
    (no bindings, no library, no driver)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        log.info("node.nvml_unavailable", error=str(exc))
        return None
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        nvlink = _groups(handles, lambda a, b: _nvlink_peers(pynvml, a, b))
        pcie = _groups(handles, lambda a, b: _same_host_bridge(pynvml, a, b))
        gpus = []
        for index, handle in enumerate(handles):
            gpus.append(
                GpuInfo(
                    index=index,
                    type=gpu_type_from_name(_text(pynvml.nvmlDeviceGetName(handle))),
                    memory_mb=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total) // MIB,
                    uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                    pci_bus_id=_text(pynvml.nvmlDeviceGetPciInfo(handle).busId),
                    nvlink_group=nvlink[index],
                    pcie_group=pcie[index],
                )
            )
        return tuple(gpus)
    except pynvml.NVMLError as exc:
        # A driver that answers nvmlInit but fails a query: report nothing rather than half a node.
        log.warning("node.nvml_query_failed", error=str(exc))
        return ()
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def _nvlink_peers(pynvml: Any, a: Any, b: Any) -> bool:
    try:
        status = pynvml.nvmlDeviceGetP2PStatus(a, b, pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
    except pynvml.NVMLError:  # GPUs without NVLink answer NOT_SUPPORTED on some drivers
        return False
    return bool(status == pynvml.NVML_P2P_STATUS_OK)


def _same_host_bridge(pynvml: Any, a: Any, b: Any) -> bool:
    try:
        level = pynvml.nvmlDeviceGetTopologyCommonAncestor(a, b)
    except pynvml.NVMLError:
        return False
    return bool(level <= pynvml.NVML_TOPOLOGY_HOSTBRIDGE)


def _groups(items: Sequence[Any], linked: Callable[[Any, Any], bool]) -> list[int]:
    """Connected components of ``linked`` over ``items``, numbered from 1 in item order; an item
    linked to nothing gets 0."""
    parent = list(range(len(items)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    touched = [False] * len(items)
    for i in range(len(items)):
        for j in range(i + 1, len(items)):
            if linked(items[i], items[j]):
                touched[i] = touched[j] = True
                parent[root(j)] = root(i)
    numbers: dict[int, int] = {}
    groups = []
    for i in range(len(items)):
        if not touched[i]:
            groups.append(0)
            continue
        groups.append(numbers.setdefault(root(i), len(numbers) + 1))
    return groups


def detect_torch() -> tuple[GpuInfo, ...] | None:
    """The GPUs ``torch.cuda`` sees (name, memory, PCI id; no topology); None without torch."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        uuid = str(getattr(props, "uuid", "") or "")
        domain, bus, device = (getattr(props, f"pci_{part}_id", None) for part in ("domain", "bus", "device"))
        gpus.append(
            GpuInfo(
                index=index,
                type=gpu_type_from_name(props.name),
                memory_mb=int(props.total_memory) // MIB,
                uuid=f"GPU-{uuid}" if uuid and not uuid.startswith("GPU-") else uuid,
                pci_bus_id=f"{domain:08X}:{bus:02X}:{device:02X}.0"
                if None not in (domain, bus, device)
                else "",
            )
        )
    return tuple(gpus)
