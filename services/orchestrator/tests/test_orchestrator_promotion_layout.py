"""What a promotion deploys: the deployment's name for a version, and the model folder laid out so
the ``forge`` engine lists the version (the gateway routes ``name:version`` by it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forge_kit.modelref import ModelRef
from forge_orchestrator.config import OrchestratorSettings
from forge_orchestrator.deploy.model import DeploymentInput, validate_deployment
from forge_orchestrator.deploy.promotion import deployment_name, lay_out, promotion_serving


def test_deployment_names_are_valid_and_distinct_per_version() -> None:
    assert deployment_name(ModelRef("tiny", "v2")) == "tiny-v2"
    assert deployment_name(ModelRef("tiny", "")) == "tiny"
    # Names that had to change carry a digest of the version, so two versions never share one.
    changed = [ModelRef("Tiny_Chat", "2.1"), ModelRef("tiny_chat", "2-1"), ModelRef("a" * 50, "b" * 40)]
    names = [deployment_name(m) for m in changed]
    assert names[0].startswith("tiny-chat-2-1-") and len(set(names)) == 3
    for name in ["tiny-v2", *names]:
        validate_deployment(
            DeploymentInput(
                name=name, team="serving", model="tiny", model_dir="/m/tiny", gpu_type="SERVE", replicas=1
            )
        )


def test_the_layout_links_the_checkpoint_and_names_the_version(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt-000100"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    (checkpoint / "model.safetensors").write_bytes(b"weights")
    (checkpoint / "forge_model.json").write_text('{"version": "stale"}')
    folder = lay_out(tmp_path / "promoted", ModelRef("tiny", "v7"), checkpoint)
    assert folder == tmp_path / "promoted" / "tiny-v7" / "tiny"
    assert (folder / "model.safetensors").resolve() == (checkpoint / "model.safetensors").resolve()
    assert json.loads((folder / "forge_model.json").read_text()) == {"version": "v7"}
    assert json.loads((checkpoint / "forge_model.json").read_text()) == {"version": "stale"}
    # Laid out again (an activity retried): the same folder, nothing doubled.
    assert lay_out(tmp_path / "promoted", ModelRef("tiny", "v7"), checkpoint) == folder
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json",
        "forge_model.json",
        "model.safetensors",
    ]


def test_promotions_roll_replicas_only_when_configured(tmp_path: Path) -> None:
    assert promotion_serving(OrchestratorSettings()) is None
    with pytest.raises(ValueError, match="promote_deploy_gpu_type"):
        OrchestratorSettings(promote_deploy=True)
    serving = promotion_serving(
        OrchestratorSettings(promote_deploy=True, promote_deploy_gpu_type="SERVE", data_dir=str(tmp_path))
    )
    assert serving is not None and serving.gpu_type == "SERVE" and serving.engine == "forge"
    assert serving.layout_dir == str(tmp_path / "promoted")


def test_replica_interpreters_are_absolute_or_looked_up_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Replicas start in their own run folders: a relative interpreter would name nothing there.
    monkeypatch.chdir(tmp_path)
    settings = OrchestratorSettings()
    assert settings.deploy_vllm_python == str(tmp_path / ".venv-vllm" / "bin" / "python")
    assert settings.deploy_forge_python == "python"
    absolute = OrchestratorSettings(deploy_vllm_python="/opt/vllm/bin/python")
    assert absolute.deploy_vllm_python == "/opt/vllm/bin/python"
