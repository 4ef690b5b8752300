"""What a promotion deploys: the deployment's name for a version, and the model folder laid out so
the ``forge`` engine lists the version (the gateway routes ``name:version`` by it); and which
``ModelPromoted`` events start a ``promotion_rollout`` workflow, with what input."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import pytest
from forge.common.v1 import common_pb2
from forge.events.v1 import events_pb2

from forge_kit import errors
from forge_kit.modelref import ModelRef
from forge_orchestrator.config import OrchestratorSettings
from forge_orchestrator.deploy.model import DeploymentInput, validate_deployment
from forge_orchestrator.deploy.promoted import PromotionRolloutInput, validate_promotion_rollout
from forge_orchestrator.deploy.promotion import (
    deployment_name,
    lay_out,
    promotion_deployment,
    promotion_serving,
)
from forge_orchestrator.event_handlers import PromotionHandler
from forge_orchestrator.service import KINDS, parse_input
from forge_orchestrator.synthetic.model import SyntheticInput, validate_synthetic
from forge_orchestrator.synthetic.workflow import student_ref


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
    # By default a promoted version runs a fixed number of replicas.
    fixed = promotion_deployment(serving, ModelRef("tiny", "v3"), tmp_path / "tiny")
    assert (fixed.min_replicas, fixed.replicas, fixed.max_replicas, fixed.autoscale) == (1, 1, 1, False)
    validate_deployment(fixed)


def test_a_promoted_version_autoscales_up_to_the_maximum_when_one_is_set(tmp_path: Path) -> None:
    settings = OrchestratorSettings(
        promote_deploy=True,
        promote_deploy_engine="vllm",
        promote_deploy_gpu_type="H100",
        promote_deploy_replicas=2,
        promote_deploy_max_replicas=8,
        promote_deploy_engine_args=["--max-num-seqs", "64"],
    )
    serving = promotion_serving(settings)
    assert serving is not None
    spec = promotion_deployment(serving, ModelRef("tiny", "v3"), tmp_path / "hf")
    assert (spec.min_replicas, spec.replicas, spec.max_replicas, spec.autoscale) == (2, 2, 8, True)
    assert (spec.name, spec.engine, spec.gpu_type, spec.engine_args) == (
        "tiny-v3",
        "vllm",
        "H100",
        ["--max-num-seqs", "64"],
    )
    validate_deployment(spec)
    with pytest.raises(ValueError, match="promote_deploy_max_replicas"):
        OrchestratorSettings(
            promote_deploy=True,
            promote_deploy_gpu_type="H100",
            promote_deploy_replicas=3,
            promote_deploy_max_replicas=2,
        )


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


class RecordingStarter:
    """The :class:`~forge_orchestrator.event_handlers.WorkflowStarter` seam, recording what it starts."""

    def __init__(self) -> None:
        self.started: list[tuple[str, dict[str, object], str]] = []

    async def start_workflow(
        self, workflow_type: str, data: Mapping[str, object], workflow_id: str = ""
    ) -> tuple[str, str]:
        self.started.append((workflow_type, dict(data), workflow_id))
        return workflow_id, "run"


def _promoted(
    stage: str, version: str, previous: str = "", *, rollback: bool = False
) -> events_pb2.ModelPromoted:
    event = events_pb2.ModelPromoted(
        model=common_pb2.ModelRef(name="tiny", version=version), stage=stage, is_rollback=rollback
    )
    if previous:
        event.previous.CopyFrom(common_pb2.ModelRef(name="tiny", version=previous))
    event.meta.event_id = f"ev-{stage}-{version}"
    return event


async def test_every_serving_promotion_starts_one_rollout_named_after_its_event() -> None:
    starter = RecordingStarter()
    handler = PromotionHandler(starter, poll_s=0.5)
    await handler.handle(_promoted("production", "v1", "v0", rollback=True), session=None)  # type: ignore[arg-type]
    await handler.handle(_promoted("canary", "v2"), session=None)  # type: ignore[arg-type]
    await handler.handle(_promoted("archived", "v3"), session=None)  # type: ignore[arg-type]
    assert starter.started == [
        (
            "promotion_rollout",
            {
                "model": "tiny:v1",
                "stage": "production",
                "previous": "tiny:v0",
                "is_rollback": True,
                "event_id": "ev-production-v1",
                "poll_s": 0.5,
            },
            "promotion-rollout-ev-production-v1",
        ),
        (
            "promotion_rollout",
            {
                "model": "tiny:v2",
                "stage": "canary",
                "previous": "",
                "is_rollback": False,
                "event_id": "ev-canary-v2",
                "poll_s": 0.5,
            },
            "promotion-rollout-ev-canary-v2",
        ),
    ]
    # What the handler starts is a valid input of the workflow kind it names.
    for kind, data, _ in starter.started:
        KINDS[kind].validate(parse_input(KINDS[kind].input, data))


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model": ""}, "input.model"),
        ({"model": "tiny:"}, "input.model"),
        ({"previous": "a b"}, "input.previous"),
        ({"stage": "archived"}, "input.stage"),
        ({"event_id": "x" * 61}, "input.event_id"),
        ({"poll_s": 0.0}, "input.poll_s"),
    ],
)
def test_a_rollout_input_is_checked_naming_the_field(change: dict[str, object], field: str) -> None:
    params = PromotionRolloutInput(**{"model": "tiny:v1", "stage": "production", **change})  # type: ignore[arg-type]
    with pytest.raises(errors.ValidationError) as caught:
        validate_promotion_rollout(params)
    assert caught.value.field == field


def test_a_synthetic_run_deploys_its_student_as_a_version_of_its_own(tmp_path: Path) -> None:
    """The synthetic workflow's student: the input's model name, pinned to a version derived from
    the workflow id (two runs never share a deployment), a valid deployment name and layout."""
    first, second = student_ref("student", "synthetic-a"), student_ref("student:v3", "synthetic-b")
    assert first.name == second.name == "student" and first.version != second.version
    assert first == student_ref("student", "synthetic-a") and first.version.startswith("synthetic-")
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    folder = lay_out(tmp_path / "promoted", first, checkpoint)
    assert json.loads((folder / "forge_model.json").read_text()) == {"version": first.version}
    spec = DeploymentInput(
        deployment_name(first), "serving", str(first), str(folder), replicas=1, gpu_type="SERVE"
    )
    validate_deployment(spec)
    assert spec.name == f"student-{first.version}"
    params = SyntheticInput("t", "/w", "/s", "a:b:c", templates=["add_sub"], heldout_templates=["bus_stop"])
    with pytest.raises(errors.ValidationError) as caught:
        validate_synthetic(params)
    assert caught.value.field == "input.student_model"
