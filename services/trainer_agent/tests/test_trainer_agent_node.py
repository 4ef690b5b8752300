"""Reading the node's GPUs (nvidia-smi output, the ``gpus`` setting) and the agent's settings."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from forge_trainer_agent.config import TrainerAgentSettings
from forge_trainer_agent.node import (
    GpuInfo,
    GpuSpecError,
    gpu_type_from_name,
    parse_gpu_spec,
    parse_nvidia_smi,
)

# `nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader,nounits` on an 8 x H100 SXM node.
H100_NODE = """\
0, NVIDIA H100 80GB HBM3, 81559
1, NVIDIA H100 80GB HBM3, 81559
2, NVIDIA H100 80GB HBM3, 81559
3, NVIDIA H100 80GB HBM3, 81559
4, NVIDIA H100 80GB HBM3, 81559
5, NVIDIA H100 80GB HBM3, 81559
6, NVIDIA H100 80GB HBM3, 81559
7, NVIDIA H100 80GB HBM3, 81559
"""


def test_nvidia_smi_output_of_an_h100_node() -> None:
    gpus = parse_nvidia_smi(H100_NODE)

    assert gpus == tuple(GpuInfo(index=i, type="H100", memory_mb=81559) for i in range(8))


def test_nvidia_smi_mixed_names_unknown_memory_and_blank_lines() -> None:
    output = "1, NVIDIA A100-SXM4-80GB, 81920\n\n0, Tesla V100-SXM2-16GB, [N/A]\r\n2, NVIDIA GeForce RTX 4090, 24564\n"

    gpus = parse_nvidia_smi(output)

    assert gpus == (GpuInfo(0, "V100", 0), GpuInfo(1, "A100", 81920), GpuInfo(2, "RTX-4090", 24564))


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("NVIDIA H200", "H200"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA RTX A6000", "RTX-A6000"),
        ("NVIDIA A10G", "A10G"),
        ("NVIDIA H100 PCIe", "H100"),
    ],
)
def test_gpu_type_from_marketing_name(name: str, expected: str) -> None:
    assert gpu_type_from_name(name) == expected


@pytest.mark.parametrize(
    ("output", "complaint"),
    [
        ("0, NVIDIA H100 80GB HBM3\n", "line 1: expected 'index, name, memory.total'"),
        ("0, NVIDIA H100, 81559\nGPU-1, NVIDIA H100, 81559\n", "line 2: index 'GPU-1' is not a number"),
        ("0, NVIDIA H100, 81559\n0, NVIDIA H100, 81559\n", "an index twice"),
    ],
)
def test_unreadable_nvidia_smi_output_is_an_error_not_a_missing_gpu(output: str, complaint: str) -> None:
    with pytest.raises(GpuSpecError, match=complaint):
        parse_nvidia_smi(output)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("", ()),
        ("H100x2:81559", (GpuInfo(0, "H100", 81559), GpuInfo(1, "H100", 81559))),
        ("A100-80GBx1, L4x2", (GpuInfo(0, "A100-80GB", 0), GpuInfo(1, "L4", 0), GpuInfo(2, "L4", 0))),
        ("cpu-sim", (GpuInfo(0, "cpu-sim", 0),)),
        ("RTX4090", (GpuInfo(0, "RTX4090", 0),)),
        ("Ax100x1", (GpuInfo(0, "Ax100", 0),)),
    ],
)
def test_gpu_setting(spec: str, expected: tuple[GpuInfo, ...]) -> None:
    assert parse_gpu_spec(spec) == expected


@pytest.mark.parametrize("spec", ["H100x0", "H100x300", "H100 x8", "H100x8:lots", "H100x2:"])
def test_unreadable_gpu_setting_is_refused(spec: str) -> None:
    with pytest.raises(GpuSpecError):
        parse_gpu_spec(spec)


def test_settings_refuse_a_bad_gpus_value_naming_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORGE_TRAINER_AGENT_GPUS", "H100x0")
    with pytest.raises(ValidationError) as caught:
        TrainerAgentSettings()
    assert caught.value.errors()[0]["loc"] == ("gpus",)


def test_settings_defaults_and_unknown_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = TrainerAgentSettings()
    assert (settings.grpc_port, settings.http_port, settings.scheduler_target) == (
        50052,
        8052,
        "127.0.0.1:50051",
    )
    assert settings.node_name and settings.service_name == "trainer_agent"
    monkeypatch.setenv("FORGE_TRAINER_AGENT_GPU", "H100x8")
    with pytest.raises(ValidationError, match="FORGE_TRAINER_AGENT_GPU"):
        TrainerAgentSettings()
