"""Reading the node's GPUs (device names, the ``gpus`` setting) and the agent's settings;
NVML and torch detection: ``test_trainer_agent_gpus.py``."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from forge_trainer_agent.config import TrainerAgentSettings
from forge_trainer_agent.node import (
    GpuInfo,
    GpuSpecError,
    gpu_type_from_name,
    parse_gpu_spec,
)


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


def test_the_node_names_where_its_outbox_is_read_on_a_fixed_port_only() -> None:
    from forge_trainer_agent.__main__ import node_labels
    from forge_trainer_agent.config import TrainerAgentSettings
    from forge_trainer_agent.node import ADDRESS_LABEL, EVENT_LOG_LABEL

    local = node_labels(TrainerAgentSettings(grpc_port=50052))
    assert local == {EVENT_LOG_LABEL: "127.0.0.1:50052"}
    remote = node_labels(TrainerAgentSettings(grpc_port=50052, advertise_address="10.0.0.7"))
    assert remote == {ADDRESS_LABEL: "10.0.0.7", EVENT_LOG_LABEL: "10.0.0.7:50052"}
    assert node_labels(TrainerAgentSettings(grpc_port=0)) == {}  # an ephemeral port is not known yet
